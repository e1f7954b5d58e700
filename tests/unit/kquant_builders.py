"""GGUF k-quant blocks and tiny Q4_K_M-style GGUF files for tests and benchmarks.

gguf-py dequantizes k-quants but cannot quantize them, so the blocks are random bytes with
sane fp16 super-block scales: they reach every sub-block scale, min and quant value, and
gguf-py's dequantizer says what they hold."""

import itertools

import gguf
import msgspec
import numpy as np
import torch


def random_blocks(name: str, rows: int, cols: int, seed: int, amp: float = 0.1) -> np.ndarray:
    """uint8 [rows, cols / block weights * block bytes] of `name` blocks, weights up to
    about amp. Q4_1 and Q8_0, which gguf-py quantizes, from random floats."""
    qtype = gguf.GGMLQuantizationType[name]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if name in ("Q4_1", "Q8_0"):
        floats = rng.uniform(-amp, amp, (rows, cols)).astype(np.float32)
        return gguf.quants.quantize(floats, qtype)
    raw = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)

    def scales(top: float) -> np.ndarray:  # fp16 super-block scales, as uint8 pairs
        values = (rng.uniform(0.25, 1.0, raw.shape[:2]) * top).astype(np.float16)
        return values[..., None].view(np.uint8)

    if name == "Q6_K":  # d at the end; the int8 sub-block scales carry the sign
        raw[..., 208:210] = scales(amp / (128 * 32))
    else:  # Q4_K, Q5_K: d and dmin first; 6-bit sub-block scales and mins
        quant_max = 15 if name == "Q4_K" else 31
        raw[..., 0:2] = scales(amp / (63 * quant_max))
        raw[..., 2:4] = scales(amp / 63 / 2)
    return raw.reshape(rows, -1)


def reference(blocks: np.ndarray, name: str) -> torch.Tensor:
    """gguf-py's dequantization: the weights a dense load of the file holds."""
    qtype = gguf.GGMLQuantizationType[name]
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))


class LlamaShape(msgspec.Struct, frozen=True):
    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    vocab: int = 256


def write_q4_k_m(path: str, shape: LlamaShape, q6_k: set[str], bulk: str = "Q4_K",
                 kinds: dict[str, str] | None = None) -> None:
    """A llama GGUF of random blocks: `bulk` for every matrix, Q6_K for the names in q6_k
    (llama.cpp's Q4_K_M mix gives the output and some layers' attn_v / ffn_down Q6_K), and
    the kind `kinds` names for a tensor named there."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    head_dim = shape.hidden // shape.heads
    writer.add_key_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    hidden, kv = shape.hidden, shape.kv_heads * head_dim
    matrices = {"token_embd.weight": (shape.vocab, hidden), "output.weight": (shape.vocab, hidden)}
    for i in range(shape.layers):
        matrices |= {f"blk.{i}.attn_q.weight": (hidden, hidden),
                     f"blk.{i}.attn_k.weight": (kv, hidden),
                     f"blk.{i}.attn_v.weight": (kv, hidden),
                     f"blk.{i}.attn_output.weight": (hidden, hidden),
                     f"blk.{i}.ffn_gate.weight": (shape.ffn, hidden),
                     f"blk.{i}.ffn_up.weight": (shape.ffn, hidden),
                     f"blk.{i}.ffn_down.weight": (hidden, shape.ffn)}
    for seed, (name, (rows, cols)) in enumerate(matrices.items()):
        kind = (kinds or {}).get(name) or ("Q6_K" if name in q6_k else bulk)
        amp = 1.0 if name == "token_embd.weight" else 2.0 / cols**0.5
        writer.add_tensor(name, random_blocks(kind, rows, cols, seed, amp),
                          raw_dtype=gguf.GGMLQuantizationType[kind])
    rng = np.random.default_rng(0)
    for i in range(shape.layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class MoeShape(msgspec.Struct, frozen=True):
    """A qwen3moe GGUF's sizes: every layer routed, top-k of `experts`."""

    hidden: int = 256
    expert_ffn: int = 256
    experts: int = 4
    top_k: int = 2
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    vocab: int = 256


def write_moe_kquant(path: str, shape: MoeShape, experts: str = "Q4_K",
                     down: str = "Q6_K") -> None:
    """A qwen3moe GGUF of random blocks: its stacked experts' gate and up in `experts`
    blocks, their down in `down` (llama.cpp's Q4_K_M gives some layers' ffn_down_exps Q6_K),
    attention and the LM head Q8_0; norms float32."""
    writer = gguf.GGUFWriter(path, "qwen3moe")
    head_dim = shape.hidden // shape.heads
    writer.add_block_count(shape.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.expert_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    hidden, kv, ffn = shape.hidden, shape.kv_heads * head_dim, shape.expert_ffn
    rng = np.random.default_rng(0)
    seeds = itertools.count(1)

    def add(name: str, kind: str, rows: int, cols: int, count: int = 0) -> None:
        """rows x cols weights (count of them stacked, if given) in `kind` blocks."""
        seed = next(seeds)
        if kind == "Q8_0":  # gguf-py quantizes it: random float32 weights
            values = (rng.standard_normal((rows, cols)) / cols**0.5).astype(np.float32)
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        elif not count:
            data = random_blocks(kind, rows, cols, seed, 2.0 / cols**0.5)
        else:
            data = np.stack([random_blocks(kind, rows, cols, seed * 1000 + e, 2.0 / cols**0.5)
                             for e in range(count)])
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", "Q8_0", shape.vocab, hidden)
    add("output.weight", "Q8_0", shape.vocab, hidden)
    for i in range(shape.layers):
        for proj, rows in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv),
                           ("attn_output", hidden)):
            add(f"blk.{i}.{proj}.weight", "Q8_0", rows, hidden)
        # The router: float32, as llama.cpp keeps it.
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight",
                          rng.standard_normal((shape.experts, hidden)).astype(np.float32))
        add(f"blk.{i}.ffn_gate_exps.weight", experts, ffn, hidden, shape.experts)
        add(f"blk.{i}.ffn_up_exps.weight", experts, ffn, hidden, shape.experts)
        add(f"blk.{i}.ffn_down_exps.weight", down, hidden, ffn, shape.experts)
        for norm, width in (("attn_norm", hidden), ("ffn_norm", hidden),
                            ("attn_q_norm", head_dim), ("attn_k_norm", head_dim)):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              (1 + 0.1 * rng.standard_normal(width)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def engine_core(path: str, compiled, dtype: torch.dtype = torch.float32, blocks: bool = True,
                max_len: int = 128, blocks_only: bool = True, batch_invariant: bool = False,
                budget: int = 8, kv=None):
    """An EngineCore over the GGUF at `path` and its ops: the CPU kernels (compiled) with
    the file's blocks attached (blocks) or not, or the plain torch ops (compiled None) over
    the dequantized weights. blocks_only: an MoE's block experts held as blocks alone (as
    build_engine loads them), else dequantized beside their blocks. budget: tokens a step.
    kv: a narrow KV cache (engine.attention.kv_dtype)."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.layers.cpu_ops import CpuKernelOps
    from engine.models.registry import (
        build_model,
        load_model_config,
        load_quantized_weights,
        load_weights,
    )
    from engine.step.core import EngineCore
    from engine.step.kv_cache import PageAllocator
    from engine.step.model_runner import ModelRunner
    from engine.step.scheduler import Scheduler

    cpu = torch.device("cpu")
    config = load_model_config(path)
    ops = CpuKernelOps(compiled, batch_invariant) if compiled is not None else None
    # As build_engine loads it: an MoE's block experts not dequantized where the ops take
    # them, and with blocks_only=False the dense copy too (the path before that).
    as_blocks = dtype if ops is not None and blocks and blocks_only else None
    weights = load_weights(path, config, torch.float32, experts_as_blocks=as_blocks)
    quantized = load_quantized_weights(path, config) if ops is not None and blocks else None
    model = build_model(config, weights, max_len, dtype, cpu, ops=ops, quantized=quantized)
    pages = max_len  # 4 sequences of max_len, 4 tokens a page
    backend = TorchAttentionBackend(config.num_layers, pages, 4, config.num_kv_heads,
                                    config.head_dim, dtype, cpu, kernels=compiled, kv=kv)
    allocator = PageAllocator(pages, 4)
    core = EngineCore(ModelRunner(model, backend, config.vocab_size), allocator,
                      Scheduler(allocator, budget, max_num_seqs=4), eos_token_ids=[],
                      max_model_len=max_len, vocab_size=config.vocab_size, engine_id="kquant",
                      model_name="q4_k_m-style")
    return core, model.ops
