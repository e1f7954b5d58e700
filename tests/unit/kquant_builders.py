"""GGUF k-quant blocks and tiny Q4_K_M-style GGUF files for tests and benchmarks.

gguf-py dequantizes k-quants but cannot quantize them, so the blocks are random bytes with
sane fp16 super-block scales: they reach every sub-block scale, min and quant value, and
gguf-py's dequantizer says what they hold."""

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


def engine_core(path: str, compiled, dtype: torch.dtype = torch.float32, blocks: bool = True,
                max_len: int = 128):
    """An EngineCore over the GGUF at `path` and its ops: the CPU kernels (compiled) with
    the file's blocks attached (blocks) or not, or the plain torch ops (compiled None) over
    the dequantized weights."""
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.core import EngineCore
    from engine.kv_cache import PageAllocator
    from engine.model_runner import ModelRunner
    from engine.models.config import load_model_config
    from engine.models.ops import CpuKernelOps
    from engine.models.registry import build_model
    from engine.models.weights import load_quantized_weights, load_weights
    from engine.scheduler import Scheduler

    cpu = torch.device("cpu")
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32)
    ops = CpuKernelOps(compiled) if compiled is not None else None
    quantized = load_quantized_weights(path, config) if ops is not None and blocks else None
    model = build_model(config, weights, max_len, dtype, cpu, ops=ops, quantized=quantized)
    pages = max_len  # 4 sequences of max_len, 4 tokens a page
    backend = TorchAttentionBackend(config.num_layers, pages, 4, config.num_kv_heads,
                                    config.head_dim, dtype, cpu, kernels=compiled)
    allocator = PageAllocator(pages, 4)
    core = EngineCore(ModelRunner(model, backend, config.vocab_size), allocator,
                      Scheduler(allocator, 8, max_num_seqs=4), eos_token_ids=[],
                      max_model_len=max_len, vocab_size=config.vocab_size, engine_id="kquant",
                      model_name="q4_k_m-style")
    return core, model.ops
