"""What one rank loads, up to its KV cache: the device and dtype, the attention backend,
the model over its weights (a tensor-parallel rank: its shard), and how many KV pages fit.
`engine.process.build` makes the engine of it; `engine.process.tp_worker` serves a rank
other than 0 with it."""

from __future__ import annotations

import ctypes
import logging
import os
import time

import msgspec
import torch

from engine.attention.kv_dtype import kv_cache_dtype, stored_dtype
from engine.attention.selector import (
    BackendUnavailable,
    create_attention_backend,
    for_model,
    narrow_cache_refusal,
    select_attention_backend,
)
from engine.layers.config import ModelConfig
from engine.layers.ops import make_ops
from engine.layers.quant_config import checkpoint_quantization
from engine.layers.sharding import Shard, check_tensor_parallel, local_config
from engine.layers.tp_group import SINGLE, TPGroup
from engine.models.registry import (
    build_model,
    load_model_config,
    load_quantized_weights,
    load_weights,
)
from engine.parallel.rendezvous import Rendezvous
from engine.process.device import resolve_dtype
from engine.step.pooler import TokenScoreHead
from shared.config import EngineConfig
from shared.runner_config import PoolingFacts, pooling_facts, resolve_runner
from shared.startup_checks import StartupError
from shared.tokenizer import load_tokenizer

log = logging.getLogger("sluice.engine")

# ---------------------------------------------------------------- page arithmetic


def _page_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one KV page takes: K and V (MLA: the latent) of `page_size` tokens in every
    layer, stored as --kv-cache-dtype says (fp8 / int8: one byte an element)."""
    element = stored_dtype(config.kv_cache_dtype, dtype).itemsize
    return config.page_size * model.kv_elements_per_token() * element


def kv_pages_for(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    if config.num_pages is not None:
        return config.num_pages
    return max(1, int(config.kv_cache_memory_gb * 2**30) // _page_bytes(config, model, dtype))


def _kv_cache_dtype(config: EngineConfig, model: ModelConfig, dtype: torch.dtype):
    """--kv-cache-dtype's narrow cache (engine.attention.kv_dtype), None: in dtype."""
    try:
        kv = kv_cache_dtype(config.kv_cache_dtype, dtype, model.num_layers, config.model)
    except ValueError as exc:
        raise StartupError(f"cannot serve {config.model}: {exc}") from None
    return kv


def _log_kv_cache_dtype(kv, backend) -> None:
    if kv is not None:
        where = ("the compiled kernel" if getattr(backend, "kernels", None) is not None
                 else "torch")
        log.info("KV cache stored as %s (scales: %s; decode attention: %s)",
                 str(kv.dtype).removeprefix("torch."), kv.source, where)


def _calibrated_int8(config: EngineConfig, kv, model, local: ModelConfig, dtype, device,
                     max_model_len: int):
    """int8 scales computed from one prefill of a fixed text (engine.attention.kv_calibration),
    where the checkpoint has none; the fixed ones where that cannot run (no tokenizer)."""
    from engine.attention.kv_calibration import CALIBRATION_TEXT, int8_scales

    try:
        tokenizer = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                                   model=config.model)
        ids = tokenizer.encode(CALIBRATION_TEXT)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure: the fixed scales serve
        log.warning("int8 KV scales: no tokenizer to calibrate with (%s); fixed ones", exc)
        return kv
    try:
        k, v = int8_scales(model, local, ids, dtype, device, max_model_len)
    except (RuntimeError, ValueError, TypeError) as exc:  # a model whose forward differs
        log.warning("int8 KV scales: the calibration prefill failed (%s); fixed ones", exc)
        return kv
    return msgspec.structs.replace(kv, k_scales=k, v_scales=v,
                                   source="computed at start from a fixed text")


def _narrow_cache_choice(choice, kv):
    """auto's FlashInfer choice revised for a narrow KV cache, which the torch backend
    stores; an explicit --attention-backend flashinfer is refused at its creation."""
    if kv is not None and choice.name == "flashinfer" and choice.reason.startswith("auto"):
        return type(choice)("torch", "auto: --kv-cache-dtype's narrow cache is stored on the "
                            "torch backend")
    return choice


# Besides weights, KV cache and activations a GPU engine holds FlashInfer's workspaces
# (128 MiB float, 8 MiB int per wrapper), the CUDA-graph memory pool, cuBLAS workspaces and
# allocator slack; 1 GiB covers them for the models we serve.
GPU_FIXED_RESERVE_BYTES = 2**30


def gpu_activation_reserve(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes a step's activations may take at most, estimated from the step's token budget:
    the tensors live at once inside one layer (residual, normed input, q/k/v and their
    rotated copies, attention output, gate/up, SiLU output), the float32 logits of
    max_num_seqs rows with the sampler's copies of them (softmax, sort, cumsum), and the
    fixed reserve. Prompt logprobs of a long prefill chunk come out of what
    --gpu-memory-utilization leaves free."""
    element = torch.empty((), dtype=dtype).element_size()
    q_size = model.num_heads * model.head_dim
    kv_size = model.num_kv_heads * model.head_dim
    per_token = 4 * model.hidden_size + 2 * (q_size + 2 * kv_size) + 3 * model.intermediate_size
    activations = config.max_num_batched_tokens * per_token * element
    logits = config.max_num_seqs * model.vocab_size * 4 * 6
    return activations + logits + GPU_FIXED_RESERVE_BYTES


def gpu_kv_pages(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """KV pages that fit in --gpu-memory-utilization of the GPU's memory, once the weights
    are on it (call after loading) and the activation reserve is set aside. Memory other
    processes hold on the GPU counts as used."""
    if config.num_pages is not None:
        return config.num_pages
    if not 0 < config.gpu_memory_utilization <= 1:
        raise StartupError(
            f"--gpu-memory-utilization must lie in (0, 1], not {config.gpu_memory_utilization}"
        )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = (config.gpu_memory_utilization * total - (total - free)
              - gpu_activation_reserve(config, model, dtype))
    return max(1, int(budget) // _page_bytes(config, model, dtype))


def _check_cache_holds(num_pages: int, config: EngineConfig, max_model_len: int,
                       kv_window: int | None = None) -> None:
    """One sequence of max_model_len must fit. With kv_window (every layer windowed) a
    sequence holds at most the pages of its next chunk's keys: the window - 1 tokens
    before the chunk, the chunk (at most the step budget), and one page of rounding."""
    held = max_model_len
    if kv_window is not None:
        held = min(held, kv_window - 1 + config.max_num_batched_tokens + config.page_size - 1)
    if num_pages * config.page_size < held:
        more = ("raise --gpu-memory-utilization" if config.device.startswith("cuda")
                else "give it more memory")
        raise StartupError(
            f"the KV cache ({num_pages} pages of {config.page_size} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len}; {more} or lower --max-model-len"
        )



class RankModel(msgspec.Struct):
    """What one rank loaded: its model (shard), attention backend and KV page count."""

    model: object
    backend: object
    model_config: ModelConfig  # the whole model's
    max_model_len: int
    num_pages: int
    quantized: bool  # the checkpoint has GGUF blocks the CPU kernels may multiply by
    device: torch.device
    dtype: torch.dtype
    choice: object  # the attention backend's BackendChoice
    cmd_group: object = None  # tensor parallel: the group rank 0's commands come on
    procs: list = []  # tensor parallel: (rank, Popen) of the ranks this process started
    score_head: object = None  # --hf-overrides' yes/no head (engine.step.pooler.TokenScoreHead)


def load_rank(config: EngineConfig, rdv: Rendezvous):
    """A tensor-parallel rank other than 0 (engine.process.tp_worker): its model shard, its
    attention backend, and the group rank 0's commands come on."""
    loaded = load_rank_model(config, rdv, pooling_of(config))  # an embedder's checkpoint: its names
    return loaded.model, loaded.backend, loaded.cmd_group


def _cpu_threads(config: EngineConfig, rdv: Rendezvous | None) -> int | None:
    """Torch threads for this rank: --threads (else this process's CPUs) shared equally by
    the ranks on this machine; None: torch's own choice (one rank)."""
    if rdv is None:
        return config.threads
    total = config.threads or len(os.sched_getaffinity(0))
    return max(1, total // rdv.local_world)


def load_rank_model(config: EngineConfig, rdv: Rendezvous | None,
          pooling: PoolingFacts | None = None) -> RankModel:
    """Everything one rank loads, up to its KV cache; rdv None: the only rank."""
    device = _rank_device(config, rdv)
    dtype = resolve_dtype(config.dtype, device)
    choice = _attention_choice(config, device, dtype, rdv)
    try:  # an unknown architecture, a bad config.json key: refused before anything loads
        model_config = load_model_config(config.model)
    except ValueError as exc:
        raise SystemExit(f"cannot serve {config.model}: {exc}") from None
    kv = _kv_cache_dtype(config, model_config, dtype)
    revised = _narrow_cache_choice(for_model(choice, model_config), kv)
    if kv is not None and narrow_cache_refusal(revised.name, model_config):
        raise StartupError(narrow_cache_refusal(revised.name, model_config))  # before the load
    if revised is not choice and (rdv is None or rdv.rank == 0):
        log.info("attention backend: %s (%s)", revised.name, revised.reason)
    choice = revised
    size = 1 if rdv is None else rdv.world_size
    check_tensor_parallel(model_config, size)
    local = local_config(model_config, size)  # this rank's heads
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    _check_encoder(config, model_config, pooling, max_model_len)
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is not None:
        torch.cuda.set_device(device)  # streams, graphs and kernel workspaces follow it
    if not on_gpu:  # sized up front; on a GPU the cache gets what the weights leave
        num_pages = kv_pages_for(config, local, dtype)
        _check_cache_holds(num_pages, config, max_model_len, model_config.kv_window)
    shard, tp, cmd_group, procs = None, None, None, []
    if rdv is not None:
        from engine.parallel.leader import connect, spawn_ranks

        shard = Shard.of(model_config, rdv.rank, rdv.world_size)
        procs = spawn_ranks(config, rdv)  # they load while this process does
        tp, cmd_group = connect(rdv, device, shard)
    started = time.monotonic()
    model, has_blocks, score_head = _model(config, model_config, local, max_model_len, dtype,
                                           device, choice, pooling, shard, tp)
    if rdv is None or rdv.rank == 0:
        log.info("loaded %s (%s, %s ops%s) in %.1fs", config.served_model_name, dtype,
                 model.ops.name, "" if rdv is None else f", {size} tensor-parallel ranks",
                 time.monotonic() - started)
    if on_gpu:
        num_pages = gpu_kv_pages(config, local, dtype, device)
    if tp is not None:
        num_pages = tp.min_int(num_pages)  # every rank: the same pages, rank 0's tables
    if on_gpu:
        _check_cache_holds(num_pages, config, max_model_len, model_config.kv_window)
        log.info("KV cache: %d pages of %d tokens", num_pages, config.page_size)
    if kv is not None and kv.dtype == torch.int8 and kv.source.startswith("fixed"):
        kv = _calibrated_int8(config, kv, model, local, dtype, device, max_model_len)
    try:
        backend = create_attention_backend(choice.name, local, num_pages,
                                           config.page_size, dtype, device,
                                           config.batch_invariant, kv)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if rdv is None or rdv.rank == 0:
        _log_kv_cache_dtype(kv, backend)
    return RankModel(model, backend, model_config, max_model_len, num_pages, has_blocks,
                     device, dtype, choice, cmd_group, procs, score_head)


def _rank_device(config: EngineConfig, rdv: Rendezvous | None) -> torch.device:
    """The device this rank computes on (a tensor-parallel rank: its own GPU), with torch's
    threads and seed set."""
    threads = None
    device = torch.device(config.device)
    if device.type == "cpu":
        threads = _cpu_threads(config, rdv)
    elif config.threads:
        threads = config.threads
    if threads:
        torch.set_num_threads(threads)
    if config.seed is not None:
        torch.manual_seed(config.seed)  # CPU and every CUDA device
    if rdv is not None and device.type == "cuda":
        count = torch.cuda.device_count()
        if rdv.local_world > count:
            raise StartupError(f"--tensor-parallel-size {config.tensor_parallel_size} puts "
                               f"{rdv.local_world} ranks on this machine, which has {count} "
                               "GPUs")
        device = torch.device("cuda", rdv.local_rank)
    return device


def _attention_choice(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                      rdv: Rendezvous | None):
    try:
        choice = select_attention_backend(config.attention_backend, device, dtype)
    except BackendUnavailable as exc:
        raise StartupError(str(exc)) from None
    if rdv is None or rdv.rank == 0:
        log.info("attention backend: %s (%s)", choice.name, choice.reason)
    return choice


def _check_encoder(config: EngineConfig, model_config, pooling: PoolingFacts | None,
                   max_model_len: int) -> None:
    """An encoder (BERT, RoBERTa) serves pooling only, within its learned positions."""
    if pooling is None and model_config.architecture in ("bert", "roberta"):
        raise StartupError(f"{config.model} is an encoder ({model_config.architecture}): it "
                           "serves embeddings only; start it with --runner pooling")
    if (model_config.architecture in ("bert", "roberta")
            and max_model_len > model_config.max_position_embeddings):
        # Learned positions end there: a longer prompt has no position to look up.
        raise StartupError(f"--max-model-len {max_model_len} is longer than this encoder's "
                           f"{model_config.max_position_embeddings} positions")


def _model(config: EngineConfig, model_config, local, max_model_len: int, dtype, device,
           choice, pooling: PoolingFacts | None, shard, tp):
    """This rank's model over its ops and weights: (model, whether its ops hold a GGUF's
    blocks, the pooling score head or None)."""
    try:
        ops = make_ops(choice.name, device, config.batch_invariant)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    # A GGUF MoE's experts stored in blocks the ops multiply at every row count are not
    # dequantized at all (experts are most of such a model's bytes); a tensor-parallel rank
    # dequantizes its part of each expert instead.
    experts_as_blocks = (dtype if device.type == "cpu" and shard is None
                         and ops.multiplies_blocks(dtype) else None)
    _check_quantized(config, device, dtype, ops, shard)
    try:  # a missing or misshapen tensor: named
        weights = load_weights(config.model, model_config, torch.float32,
                               pooling=pooling is not None, shard=shard, map_experts_as=dtype,
                               experts_as_blocks=experts_as_blocks)
    except ValueError as exc:
        raise SystemExit(f"cannot serve {config.model}: {exc}") from None
    # A GGUF's blocks, as the ops multiply small batches by them (a rank: its part of each).
    try:  # a quantized folder's missing, misshapen or unrunnable tensor: named
        quantized = (load_quantized_weights(config.model, model_config, shard)
                     if device.type == "cpu" else {})
    except ValueError as exc:
        raise SystemExit(f"cannot serve {config.model}: {exc}") from None
    has_blocks = bool(quantized)
    try:
        model = build_model(local, weights, max_model_len, dtype, device, ops=ops,
                            quantized=quantized, tp=tp)
    except ValueError as exc:  # a weight the batch-invariant kernels cannot take
        raise StartupError(str(exc)) from None
    score_head = (_score_head(config, model_config, weights, pooling.score_tokens, device,
                              tp or SINGLE)
                  if pooling is not None and pooling.score_tokens else None)
    del weights, quantized  # the ops hold the blocks repacked
    _return_freed_memory()
    return model, has_blocks, score_head


def _check_quantized(config: EngineConfig, device, dtype, ops, shard) -> None:
    """A GPTQ / AWQ / compressed-tensors checkpoint (or --quantization) is served where its
    linears run as blocks, never dequantized: the CPU kernels, one rank. Refused in one line
    otherwise, as is a --quantization the checkpoint's quantization_config disagrees with."""
    if config.model.endswith(".gguf"):
        if config.quantization not in (None, "gguf"):
            raise StartupError(f"--quantization {config.quantization}: {config.model} is a "
                               "GGUF file (--quantization gguf, or none)")
        return
    try:
        scheme = checkpoint_quantization(config.model, config.quantization)
    except ValueError as exc:
        raise StartupError(f"cannot serve {config.model}: {exc}") from None
    if scheme is None:
        return
    where = ("CUDA" if device.type != "cpu" else "tensor parallelism" if shard is not None
             else None if ops.multiplies_blocks(dtype) else f"{ops.name} ops in {dtype}")
    if where is not None:
        raise StartupError(f"cannot serve {config.model}: its {scheme.method} 4-bit linears "
                           "run in place on the CPU kernels only (one rank, float32, or "
                           f"bfloat16 where the CPU has AVX512-BF16), not with {where}")


def _return_freed_memory() -> None:
    """Hand the heap's freed pages back to the OS once the weights are loaded: glibc keeps
    the load's transient copies (float32 tensors before they were fused, cut or repacked)
    as free heap, which otherwise stays in the process's resident set, about half the
    weights' bytes again (docs/benchmarks.md, *Tensor parallelism*)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back
        pass


def _score_head(config: EngineConfig, model_config, weights, tokens: list[str], device,
                tp: TPGroup) -> TokenScoreHead:
    """--hf-overrides' yes/no head from the LM head's rows of its two tokens. Under tensor
    parallelism each rank holds a part of the vocabulary, so the two rows may lie on two
    ranks: each rank gives what it holds of row(true) - row(false), zeros elsewhere, and
    one sum at start gives every rank the whole difference (rank 0's head uses it)."""
    head = weights.get("lm_head.weight")
    if head is None and model_config.tie_word_embeddings:
        head = weights.get("model.embed_tokens.weight")
    if model_config.architecture in ("bert", "roberta") or head is None:
        raise StartupError("--hf-overrides makes a decoder (a *ForCausalLM with an LM head) a "
                           f"yes/no reranker; {config.model} is not one")
    vocab = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode,
                           model=config.model).get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise StartupError(f"--hf-overrides classifier_from_token {missing} are not single "
                           "tokens of this model's vocabulary")
    ids = [vocab[t] for t in tokens]
    if max(ids) >= model_config.vocab_size:
        raise StartupError(f"--hf-overrides tokens {tokens} lie outside the LM head")
    start = tp.shard.vocab_range(model_config.vocab_size)[0] if tp.parallel else 0
    difference = torch.zeros(head.shape[1], dtype=torch.float32)
    for token_id, sign in ((ids[1], 1.0), (ids[0], -1.0)):
        row = token_id - start
        if 0 <= row < head.shape[0]:  # this rank's part of the vocabulary
            difference += sign * head[row].to(torch.float32)
    return TokenScoreHead(tp.sum_at_start(difference.to(device)), device)


def pooling_of(config: EngineConfig) -> PoolingFacts | None:
    """The pooling facts of a pooling engine (vLLM's --runner pooling); None: it generates."""
    if resolve_runner(config.model, config.runner, config.hf_overrides) != "pooling":
        return None
    try:
        facts = pooling_facts(config.model, config.pooler_config, config.hf_overrides)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    log.info("pooling runner: %s pooling, normalize=%s", facts.pooler.pooling_type,
             facts.pooler.normalize)
    return facts
