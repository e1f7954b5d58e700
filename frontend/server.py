"""The frontend process: tokenizer, engine client, and uvicorn serving the app."""

from __future__ import annotations

import logging

import uvicorn

from frontend.app import build_app
from frontend.engine_client import EngineClient
from frontend.rendering import TemplateSettings, load_chat_template
from frontend.serving import ServingContext
from frontend.tokenization import InputSettings, Tokenization
from postproc.processor import OutputProcessor
from shared.config import FrontendConfig
from shared.tokenizer import TokenizerFacts, load_tokenizer, tokenizer_facts

log = logging.getLogger("sluice.frontend")


def _input_settings(config: FrontendConfig, facts: TokenizerFacts) -> InputSettings:
    templates = TemplateSettings(
        chat_template=load_chat_template(config.chat_template),
        trust_request_chat_template=config.trust_request_chat_template,
    )
    return InputSettings(
        max_chars_per_token=facts.max_chars_per_token,
        pad_token_id=facts.pad_token_id,
        threads=config.tokenizer_threads,
        render_timeout_s=config.render_timeout_s,
        templates=templates,
    )


def run_frontend(config: FrontendConfig) -> None:
    tokenizer = load_tokenizer(config.model)
    facts = tokenizer_facts(tokenizer, config.model)
    # The receiver thread detokenizes with its own copy; tokenizers are not shared across threads.
    processor = OutputProcessor(load_tokenizer(config.model))
    client = EngineClient(
        config.engine_address,
        processor,
        result_address=config.result_address,
        heartbeat_interval_s=config.heartbeat_interval_s,
        engine_timeout_s=config.engine_timeout_s,
    )
    ctx = ServingContext(
        client=client,
        tokenization=Tokenization(tokenizer, _input_settings(config, facts)),
        model_name=config.served_model_name,
        vocab_size=facts.max_token_id + 1,
    )
    app = build_app(ctx)
    log.info("frontend on http://%s:%d (engine %s)", config.host, config.port,
             config.engine_address)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
