"""The frontend process: tokenizer, engine client, and uvicorn serving the app."""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import time

import msgspec
import uvicorn

from frontend.engine_client.client import EngineClient
from frontend.engine_client.consistency import ServedIdentity
from frontend.engine_client.request_log import RequestLog, log_requests
from frontend.http.app import build_app
from frontend.http.limits import Admission, drain
from frontend.http.metrics import process_exiting
from frontend.http.readiness import Readiness
from frontend.input.grammar_check import GrammarChecker, TokenizerSpec
from frontend.input.media import MediaSettings
from frontend.input.model_parsers import model_type, with_model_parsers
from frontend.input.multimodal import load_vision_processor
from frontend.input.rendering import TemplateSettings, load_chat_template
from frontend.input.structured import StructuredSettings
from frontend.input.tokenization import InputSettings, Tokenization
from frontend.pipeline.serving_context import OutputSettings, ServingContext
from postproc.processor import OutputProcessor
from postproc.reasoning import get_reasoning_parser
from shared.config import FrontendConfig
from shared.generation_config import load_generation_defaults
from shared.log_format import uvicorn_log_config
from shared.runner_config import encoder_lower_case, resolve_runner
from shared.tokenizer import (
    TokenizerFacts,
    load_tokenizer,
    tokenizer_facts,
    tokenizer_fingerprint,
)

log = logging.getLogger("sluice.frontend")


def _structured_settings(config: FrontendConfig, tokenizer, facts: TokenizerFacts
                         ) -> StructuredSettings:
    import llguidance.hf

    if resolve_runner(config.model, config.runner, config.hf_overrides) == "pooling":
        return StructuredSettings()  # a pooling model samples nothing: no grammars to check
    # Built once (about a second): validation then also knows the model's special tokens.
    llg = llguidance.hf.from_tokenizer(
        tokenizer, n_vocab=facts.max_token_id + 1, eos_token=facts.eos_token_ids
    )
    # llguidance checks requests' grammars in a worker process: a crash costs one request.
    checker = GrammarChecker(TokenizerSpec.from_hf(
        tokenizer, facts.max_token_id + 1, facts.eos_token_ids))
    checker.start()
    return StructuredSettings(
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        tokenizer=llg,
        checker=checker,
    )


def _input_settings(config: FrontendConfig, tokenizer, facts: TokenizerFacts) -> InputSettings:
    templates = TemplateSettings(
        chat_template=load_chat_template(config.chat_template),
        trust_request_chat_template=config.trust_request_chat_template,
        default_kwargs=config.default_chat_template_kwargs,
        content_format=config.chat_template_content_format,
        harmony=model_type(config.model) == "gpt_oss",
        mistral=getattr(tokenizer, "mistral", None) is not None,  # mistral-common renders
    )
    return InputSettings(
        max_chars_per_token=facts.max_chars_per_token,
        pad_token_id=facts.pad_token_id,
        pad_side="left" if tokenizer.padding_side == "left" else "right",
        do_lower_case=encoder_lower_case(config.model),
        threads=config.tokenizer_threads,
        render_timeout_s=config.render_timeout_s,
        templates=templates,
        structured=_structured_settings(config, tokenizer, facts),
        eos_token_ids=tuple(facts.eos_token_ids),
    )


def _think_tag_ids(tokenizer, reasoning_parser: str | None) -> dict:
    """The reasoning parser's tags as token ids, for thinking_token_budget."""
    if reasoning_parser is None:
        return {}
    parser = get_reasoning_parser(reasoning_parser)
    return {"think_start_ids": tuple(tokenizer.encode(parser.start_tag, add_special_tokens=False)),
            "think_end_ids": tuple(tokenizer.encode(parser.end_tag, add_special_tokens=False))}


def run_frontend(config: FrontendConfig) -> None:
    config = with_model_parsers(config)  # gpt-oss: the Harmony parsers unless named
    tokenizer = _load_tokenizer(config)
    # The receiver thread detokenizes with its own copy; tokenizers are not shared across threads.
    client = _engine_client(config, OutputProcessor(copy.deepcopy(tokenizer)))
    client.identity = ServedIdentity(config.served_model_name, tokenizer_fingerprint(tokenizer))
    app = build_app(_serving_context(config, tokenizer, client), config)
    server = _server(config, app, client)
    try:
        server.run()
    finally:
        process_exiting()


def _load_tokenizer(config: FrontendConfig):
    return load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                          model=config.model)


def _engine_client(config: FrontendConfig, processor: OutputProcessor) -> EngineClient:
    """The client of every engine the flags name, with its request timeout and log."""
    client = EngineClient(
        config.engine_addresses or config.engine_address,
        processor,
        result_address=config.result_address,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        routing=config.routing,
        engine_timeout_s=config.engine_timeout_s,
        migration_limit=config.migration_limit,
    )
    client.tracker.request_timeout_s = config.request_timeout_s
    log_requests(config.log_requests)
    if config.log_requests:
        client.tracker.request_log = RequestLog(outputs=config.log_outputs)
    return client


def _serving_context(config: FrontendConfig, tokenizer, client: EngineClient) -> ServingContext:
    """What every route reads: the model's names, its tokenization, generation defaults,
    image processor and output settings."""
    facts = tokenizer_facts(tokenizer, config.model)
    defaults = load_generation_defaults(config.model, config.generation_config,
                                        config.override_generation_config)
    log.info("generation defaults in force (--generation-config %s): %s",
             config.generation_config, defaults.in_force() or "none (the OpenAI defaults)")
    media = MediaSettings(allowed_local_media_path=config.allowed_local_media_path,
                          max_images_per_prompt=config.limit_mm_per_prompt)
    return ServingContext(
        client=client,
        tokenization=Tokenization(tokenizer, _input_settings(config, tokenizer, facts)),
        model_name=config.served_model_name,
        model_aliases=tuple(config.served_model_aliases),
        model_source=config.model,
        started=int(time.time()),
        vocab_size=facts.max_token_id + 1,
        generation_defaults=defaults,
        vision=load_vision_processor(config.model, tokenizer, media),
        media=media,
        output=OutputSettings(
            reasoning_parser=config.reasoning_parser,
            tool_call_parser=config.tool_call_parser,
            reasoning_field=config.reasoning_field,
            response_role=config.response_role,
            **_think_tag_ids(tokenizer, config.reasoning_parser),
            return_tokens_as_token_ids=config.return_tokens_as_token_ids,
            prompt_tokens_details=config.prompt_tokens_details,
            force_include_usage=config.force_include_usage,
        ),
    )


def _server(config: FrontendConfig, app, client: EngineClient) -> DrainingServer:
    """uvicorn over the app, with the drain on SIGTERM and the ready announcement."""
    http = config.http
    where = (f"unix:{http.uds}" if http.uds else
             f"{'https' if http.ssl_certfile else 'http'}://{config.host}:{config.port}")
    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            uds=http.uds,
            root_path=http.root_path,
            ssl_keyfile=http.ssl_keyfile,
            ssl_certfile=http.ssl_certfile,
            ssl_ca_certs=http.ssl_ca_certs,
            ssl_cert_reqs=http.ssl_cert_reqs,
            loop="uvloop",
            http="httptools",
            log_level=http.log_level,
            # uvicorn's error and access lines through this process's formatter.
            log_config=uvicorn_log_config(),
            access_log=http.access_log,
            # Our drain has already finished or failed every request by the time uvicorn
            # shuts down; this only bounds a second signal's wait.
            timeout_graceful_shutdown=5,
        ),
        app.state.admission, client, config.shutdown_timeout_s,
        Announcement(app.state.readiness, where + http.root_path, config.served_model_name,
                     f"engines {', '.join(config.engine_addresses or [config.engine_address])}, "
                     f"routing {config.routing}"),
    )


class Announcement(msgspec.Struct):
    """What the frontend says about itself: where it listens, what it serves, and where its
    engines are (`frontend.http.readiness` says when it is ready)."""

    readiness: Readiness
    url: str
    model: str
    engines: str


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains (new requests 503, in-flight ones finish
    for up to shutdown_timeout_s) before the usual shutdown; a second one exits at once.
    It says "ready" only when a request would be served (`frontend.http.readiness`), not when the
    socket is bound, as uvicorn's "running on" line did (requests got 503s for a while)."""

    def __init__(self, config: uvicorn.Config, admission: Admission, client: EngineClient,
                 shutdown_timeout_s: float, announcement: Announcement) -> None:
        super().__init__(config)
        self.admission = admission
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self.announcement = announcement
        self._drain: asyncio.Task | None = None
        self._announcer: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            a = self.announcement
            self._announcer = asyncio.ensure_future(a.readiness.announce(a.url, a.model))

    async def shutdown(self, sockets=None) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
        await super().shutdown(sockets)

    def _log_started_message(self, listeners) -> None:
        a = self.announcement
        log.info("frontend listening on %s (%s); ready once an engine answers", a.url,
                 a.engines)

    def handle_exit(self, sig: int, frame) -> None:
        if self.admission.draining or not hasattr(self, "_loop") or not self.started:
            return super().handle_exit(sig, frame)
        log.info("%s: draining", signal.Signals(sig).name)
        self.admission.draining = True
        # A signal handler must not touch the loop directly.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(
            drain(self.admission, self.client, self.shutdown_timeout_s))
        self._drain.add_done_callback(self._drained)

    def _drained(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("drain failed", exc_info=task.exception())
        self.should_exit = True
