"""Building an engine from its config: what rank 0 loaded (`engine.process.load`: device,
dtype, attention backend, model and weights, KV pages), and the EngineCore that ties them
together with the scheduler, the LoRA adapters, the drafter and the grammar backend.

`engine.process.server.run_engine` calls `build_engine` before it opens any socket; benchmarks and
tests call it to get a core without the process around it. What only the loaded model can
tell (the KV cache holding one sequence, kernels the weights need) stops it the way the
start-up checks do: one `sluice: ...` line (`shared.startup_checks.StartupError`)."""

from __future__ import annotations

import logging

import torch

from engine.layers.cpu_ops import QUANTIZED_MAX_ROWS
from engine.parallel.rendezvous import Rendezvous
from engine.process.load import RankModel, load_rank_model, pooling_of
from engine.request.grammar import GrammarBackend
from engine.step.core import EngineCore
from engine.step.kv_cache import PageAllocator
from engine.step.lora_adapters import LoraError, LoraManager
from engine.step.model_runner import ModelRunner
from engine.step.scheduler import Scheduler
from engine.step.spec_decode import Drafter
from shared.config import EngineConfig
from shared.startup_checks import StartupError
from shared.tokenizer import load_tokenizer, tokenizer_facts, tokenizer_fingerprint

log = logging.getLogger("sluice.engine")

# ---------------------------------------------------------------- speculative decoding

# Rows a step may hold, drafts included, before drafting stops paying: on the CPU the
# quantized kernels' small-batch path (past it a step reads the dense bfloat16 weights, 3 to
# 4 times the bytes), else a guess, measured in docs/benchmarks.md only for the default.
CPU_DENSE_DRAFT_STEP_TOKENS = 8
GPU_DRAFT_STEP_TOKENS = 64


def _drafter(config: EngineConfig, device: torch.device, quantized: bool) -> Drafter | None:
    if config.speculative is None:
        return None
    if device.type == "cuda":
        step = GPU_DRAFT_STEP_TOKENS
    else:
        step = QUANTIZED_MAX_ROWS if quantized else CPU_DENSE_DRAFT_STEP_TOKENS
    return Drafter(config.speculative, step_tokens=step)


# ---------------------------------------------------------------- the engine


def _lora_manager(config: EngineConfig, model, peers=None) -> LoraManager | None:
    """--enable-lora: the model's linears take adapters; --lora-modules load now (a bad one
    stops the start, naming it). peers: tensor parallel, what sends a load or removal to
    the other ranks."""
    if not config.enable_lora:
        return None
    if config.batch_invariant:  # the adapters' products go through oneDNN, row count and all
        raise StartupError("--enable-lora cannot run with --batch-invariant yet: the adapters' "
                           "products are not batch-invariant")
    lora = LoraManager(model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
    lora.peers = peers
    for info in config.lora_modules:
        try:
            lora.load(info)
        except LoraError as exc:
            raise StartupError(f"--lora-modules {info.name}: {exc}") from None
    return lora


def build_engine(config: EngineConfig) -> EngineCore:
    rdv = _rendezvous(config)
    pooling = pooling_of(config)
    loaded = load_rank_model(config, rdv, pooling)
    model, backend, model_config = loaded.model, loaded.backend, loaded.model_config
    max_model_len, num_pages = loaded.max_model_len, loaded.num_pages
    if rdv is not None:  # rank 0 stands in for every rank (engine.parallel.leader)
        model, backend = _leader(loaded)
    try:  # the adapters' loads and removals reach every rank (LeaderModel.lora_change)
        lora = _lora_manager(config, loaded.model,  # the shard, not rank 0's stand-in
                             model.lora_change if rdv is not None else None)
    except StartupError:
        if rdv is not None:
            model.close()
        raise
    vision = _vision(config, loaded)
    # Graphs replay decode batches padded to captured sizes through the decode-only plan;
    # the batch-invariant mode plans every row alike and runs eagerly, and so do MoE models:
    # their expert groups are sized on the host each step, which a captured graph cannot do.
    # A pooling engine never decodes; LoRA steps group the adapters' rows on the host;
    # tensor-parallel ranks run eagerly too (graphs over collectives: not done yet).
    eager = (config.enforce_eager or config.batch_invariant or model_config.moe is not None
             or pooling is not None or lora is not None or rdv is not None)
    if loaded.choice.name == "flashinfer" and not eager:
        model = _graphed(model, backend, config.max_num_seqs, max_model_len)
    allocator = PageAllocator(num_pages, config.page_size)
    tokenizer = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                               model=config.model)
    facts = tokenizer_facts(tokenizer, config.model)
    runner = ModelRunner(model, backend, model_config.vocab_size, vision,
                         pooler=pooling.pooler if pooling is not None else None)
    runner.lora_ops = lora.ops if lora is not None else None
    if loaded.score_head is not None:
        runner.classifier_head = loaded.score_head
    return EngineCore(
        runner,
        allocator,
        _scheduler(config, loaded, allocator, pooling is not None, lora is not None),
        eos_token_ids=facts.eos_token_ids,
        max_model_len=max_model_len,
        vocab_size=model_config.vocab_size,
        engine_id=config.engine_id,
        model_name=config.served_model_name,
        # A pooling engine samples nothing: no grammar (nor llguidance's tokenizer needs).
        grammar=(None if pooling is not None else
                 GrammarBackend(tokenizer, model_config.vocab_size, facts.eos_token_ids)),
        max_logprobs=config.max_logprobs,
        pooling=pooling,
        hidden_size=model_config.hidden_size,
        lora=lora,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
    )


def _leader(loaded: RankModel):
    """Rank 0's model and backend as stand-ins for every rank's: each call also goes to the
    other ranks."""
    from engine.parallel.leader import LeaderBackend, LeaderModel, Watchdog

    backend = LeaderBackend(loaded.backend)
    return LeaderModel(loaded.model, loaded.cmd_group, loaded.procs,
                       Watchdog(loaded.procs) if loaded.procs else None), backend


def _vision(config: EngineConfig, loaded: RankModel):
    """A VLM's vision half (the text half is the model); None for a text-only model."""
    if loaded.model_config.multimodal != "idefics3":
        return None
    from engine.models.idefics3 import Idefics3Vision

    return Idefics3Vision(config.model, loaded.dtype, loaded.device)


def _graphed(model, backend, max_num_seqs: int, max_model_len: int):
    """The model behind CUDA graphs of its decode steps, captured now."""
    from engine.step.cuda_graphs import DecodeGraphModel, graph_batch_sizes

    model = DecodeGraphModel(model, backend, graph_batch_sizes(max_num_seqs), max_model_len)
    model.capture()
    return model


def _scheduler(config: EngineConfig, loaded: RankModel, allocator: PageAllocator,
               pooling: bool, lora: bool) -> Scheduler:
    max_batched = config.max_num_batched_tokens
    if pooling:
        # A pooling request is prefilled whole in one step (engine.step.scheduler), as vLLM
        # turns chunked prefill off for pooling models.
        max_batched = max(max_batched, loaded.max_model_len)
    return Scheduler(allocator, max_batched, config.max_num_seqs,
                     config.scheduling_policy, config.long_prefill_token_threshold,
                     drafter=_drafter(config, loaded.device, loaded.quantized),
                     max_loras=config.max_loras if lora else 0,
                     kv_window=loaded.model_config.kv_window)


def _rendezvous(config: EngineConfig) -> Rendezvous | None:
    from engine.parallel.rendezvous import plan_rendezvous

    return plan_rendezvous(config.tensor_parallel_size, config.nnodes, config.node_rank,
                           config.master_addr, config.master_port)
