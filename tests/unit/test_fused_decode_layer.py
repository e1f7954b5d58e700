"""A whole decoder layer in one kernel call at decode (CpuKernelOps.decode_layer): pure decode
steps over GGUF blocks take it, and give the bits of the per-op path (the same kernels in
the same order), step by step, on both builds; steps it cannot take run op by op."""

import pytest
import torch

from engine.layers.cpu_ops import QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS_FLOAT32
from tests.unit.engine_builders import drain, request
from tests.unit.kquant_builders import LlamaShape, engine_core, write_q4_k_m

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: threads only add waiting

SHAPE = LlamaShape(layers=3)
# Q6_K for one down and one v: that layer's q/k/v fuse mixed kinds (Q6_K's layout).
Q6_K_TENSORS = {"output.weight", "blk.1.attn_v.weight", "blk.2.ffn_down.weight"}
PROMPTS = [[1, 5, 9, 200, 3], [7] * 11, list(range(40, 60))]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fused") / "tiny.gguf")
    write_q4_k_m(path, SHAPE, Q6_K_TENSORS)
    return path


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    """Q4_1 blocks throughout (the default model's kind): float32 rows take the int16 path."""
    path = str(tmp_path_factory.mktemp("fused") / "q4_1.gguf")
    write_q4_k_m(path, SHAPE, set(), bulk="Q4_1")
    return path


def _run(path: str, compiled, dtype: torch.dtype, fused: bool, int16: bool = True):
    """Every step's hidden rows into the LM head, and how many layers ran fused. int16: the
    int16 path at every row count the blocks take (SLUICE_CPU_INT16_ROWS=16), else off."""
    core, ops = engine_core(path, compiled, dtype)
    ops.int16_x_max_rows = QUANTIZED_MAX_ROWS_FLOAT32 if int16 and compiled.int16_dot else 0
    model = core.runner.model
    model.fuse_decode_layers = fused
    seen, calls = [], [0]
    logits, decode_layer = model.logits, ops.decode_layer

    def recording_logits(hidden):
        seen.append(hidden.clone())
        return logits(hidden)

    def counting_decode_layer(*args):
        calls[0] += 1
        return decode_layer(*args)

    model.logits, ops.decode_layer = recording_logits, counting_decode_layer
    for i, prompt in enumerate(PROMPTS):
        core.add(request(f"r{i}", prompt, max_tokens=12))
    results = drain(core)
    return seen, calls[0], [results[f"r{i}"].tokens for i in range(len(PROMPTS))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_layers_give_the_per_op_bits(compiled, gguf_file, dtype):
    if dtype is torch.bfloat16 and not compiled.bf16_quantized:
        pytest.skip("this build has no AVX512-BF16 path: bfloat16 linears are dense, "
                    "nothing to fuse")
    per_op, none, tokens = _run(gguf_file, compiled, dtype, fused=False)
    fused, calls, fused_tokens = _run(gguf_file, compiled, dtype, fused=True)
    assert none == 0
    # Prefill steps (and any step mixing one in) run op by op; the rest, every layer fused.
    assert calls > 0 and calls % SHAPE.layers == 0
    assert len(fused) == len(per_op)
    for step, (a, b) in enumerate(zip(fused, per_op, strict=True)):
        assert torch.equal(a, b), step
    assert fused_tokens == tokens


def test_fused_decode_layers_take_the_int16_path_as_the_per_op_one_does(compiled, q4_1_file):
    """With the int16 path on at every row count, over Q4_1 blocks in float32 the linears
    round x to int16 (CpuKernelOps.int16_x), fused or op by op alike: the same bits step by
    step, and not the float path's."""
    if not compiled.int16_dot:
        pytest.skip("this build has no int16 path")
    per_op, _, tokens = _run(q4_1_file, compiled, torch.float32, fused=False)
    fused, calls, fused_tokens = _run(q4_1_file, compiled, torch.float32, fused=True)
    floats, _, _ = _run(q4_1_file, compiled, torch.float32, fused=True, int16=False)
    assert calls > 0
    for step, (a, b) in enumerate(zip(fused, per_op, strict=True)):
        assert torch.equal(a, b), step
    assert fused_tokens == tokens
    # Every step differs from the float path's (prefill and decode, fused or not).
    assert len(floats) == len(fused)
    assert all(not torch.equal(a, b) for a, b in zip(fused, floats, strict=True))


def test_only_rows_the_blocks_take_run_fused(compiled):
    from engine.layers.cpu_ops import CpuKernelOps

    ops = CpuKernelOps(compiled)
    assert ops.takes_decode_layer(torch.empty(QUANTIZED_MAX_ROWS_FLOAT32, 8))
    assert not ops.takes_decode_layer(torch.empty(QUANTIZED_MAX_ROWS_FLOAT32 + 1, 8))
    assert ops.takes_decode_layer(torch.empty(QUANTIZED_MAX_ROWS, 8, dtype=torch.bfloat16))
    assert not ops.takes_decode_layer(torch.empty(QUANTIZED_MAX_ROWS + 1, 8,
                                                  dtype=torch.bfloat16))
    assert not ops.takes_decode_layer(torch.empty(1, 8, dtype=torch.float16))
    # The batch-invariant mode multiplies every row count by the blocks.
    assert CpuKernelOps(compiled, batch_invariant=True).takes_decode_layer(
        torch.empty(200, 8))
