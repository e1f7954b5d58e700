"""GPTQ, AWQ (GEMM) and compressed-tensors (pack-quantized) 4-bit checkpoints served in place
(issue 56): tiny random Llamas snapped to the 4-bit grid, written by hand in each format
(tests/unit/quant_builders.py), run by the engine over the CPU kernels' blocks and compared
with transformers over the same weights dequantized, in float32.

Tolerance: logits within 1e-3 (the symmetric checkpoints' blocks take the kernels' int16
activations path for 1-2 rows, 2^-16 of each group's largest; the others agree to ~1e-5);
greedy tokens equal, a flip forgiven only where transformers' top-2 gap is under 2e-3 (then
the rest of that prompt is not compared). Every refusal is one line at start."""

import functools
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.kernels.cpu_kernels import kernels
from engine.layers.gguf_weights import BLOCK_KINDS
from engine.layers.quant_config import WeightScheme
from engine.layers.quant_formats import (
    FLOAT_KIND,
    HALF_KIND,
    ModuleTensors,
    to_blocks,
    to_half,
    unpack_awq,
    unpack_compressed,
    unpack_gptq,
)
from engine.process.build import build_engine
from engine.process.load import _check_quantized
from engine.step.lora_adapters import LoraManager
from shared.config import EngineConfig
from shared.protocol import (
    EngineRequest,
    LoraAdapterInfo,
    SamplingParams,
    pack_ids,
    unpack_ids,
)
from sluice.cli import engine_config, parse_args
from tests.tiny_vlm import tiny_vlm_tokenizer
from tests.unit.cli_builders import serve_argvs
from tests.unit.quant_builders import (
    Snapper,
    awq_tensors,
    ct_tensors,
    gptq_tensors,
    quantize,
    rewrite_config,
)
from tests.unit.test_model_reference import STEPS, TINY, _run, make_reference

pytestmark = pytest.mark.usefixtures("one_thread")
needs_kernels = pytest.mark.skipif(kernels() is None, reason="the CPU kernels do not build")

# (format, group size, symmetric, desc_act)
CASES = {
    "gptq-sym-g32": ("gptq", 32, True, False),
    "gptq-asym-g64-desc_act": ("gptq", 64, False, True),
    "gptq_v2-sym-channel": ("gptq_v2", -1, True, False),
    "awq-g32": ("awq", 32, False, False),
    "ct-sym-g32": ("ct", 32, True, False),
    "ct-asym-channel": ("ct", -1, False, False),
}
TIE_GAP = 2e-3


def _build(path, case: str, dense_copy=None):
    """The case's checkpoint under `path` and transformers' reference run of it; dense_copy:
    where to keep the dequantized weights as a plain safetensors folder too."""
    fmt, group, sym, desc_act = CASES[case]
    snap = Snapper(fmt, group, sym, desc_act)
    ref = make_reference(path, transformers.LlamaConfig, transformers.LlamaForCausalLM,
                         dict(TINY), 8, prepare=snap)
    tiny_vlm_tokenizer().save_pretrained(path)  # build_engine loads one
    if dense_copy is not None:
        shutil.copytree(path, dense_copy)
    snap.write(str(path))
    return ref, snap


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    return request.param, *_build(tmp_path_factory.mktemp(request.param), request.param)


@needs_kernels
def test_matches_transformers(checkpoint):
    _, ref, _ = checkpoint
    tokens, logits, _ = _run(ref.path, ref.prompts, "together", kernels(), quantized=True)
    for i in range(len(ref.prompts)):
        expected = ref.step_logits[i]
        top2 = expected.topk(2, dim=-1).values
        steps = len(ref.tokens[i])
        for t, (ours, theirs) in enumerate(zip(tokens[i], ref.tokens[i], strict=True)):
            if ours != theirs:
                assert top2[t, 0] - top2[t, 1] < TIE_GAP, f"prompt {i} step {t}: no near-tie"
                steps = t
                break
        torch.testing.assert_close(logits[i][:steps + 1], expected[:steps + 1], atol=1e-3,
                                   rtol=0)


def _config(path, **fields) -> EngineConfig:
    fields = dict(dtype="float32", num_pages=64, max_num_batched_tokens=8) | fields
    return EngineConfig(model=str(path), served_model_name="m", request_address="inproc://x",
                        device="cpu", attention_backend="torch", **fields)


@needs_kernels
def test_linears_hold_packed_blocks_only(tmp_path):
    """Through the engine's own start: every decoder linear is a meta tensor (no float
    bytes) whose ops hold uint8 blocks, about the checkpoint's quantized bytes."""
    _build(tmp_path, "gptq-sym-g32")
    stored = load_file(str(tmp_path / "model.safetensors"))
    checkpoint_bytes = sum(t.numel() * t.element_size() for n, t in stored.items()
                           if n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")))
    model = build_engine(_config(tmp_path)).runner.model
    held = 0
    for layer in model.layers:
        for w in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
            assert w.is_meta
            q = model.ops._quantized[id(w)]
            assert q.blocks.dtype == torch.uint8 and q.kind == HALF_KIND and q.packed
            held += q.blocks.numel()
    # 20 bytes a 32-weight block against the checkpoint's 16 + 2 (scale) + 0.5 (zero) + 4
    # (g_idx: 4 bytes an input) per 32 weights.
    assert 0.9 * checkpoint_bytes < held < 1.1 * checkpoint_bytes


def _greedy(path, dtype: str, prompts) -> list[list[int]]:
    core = build_engine(_config(path, dtype=dtype))
    for i, prompt in enumerate(prompts):
        core.add(EngineRequest(
            request_id=f"r{i}", prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
            params=SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True),
            arrival_time=0.0))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@needs_kernels
@pytest.mark.skipif(not getattr(kernels(), "bf16_quantized", False),
                    reason="this build has no AVX512-BF16 path: bfloat16 refuses these")
def test_bfloat16_blocks_match_the_dense_bfloat16_model(tmp_path):
    """In bfloat16 the kernel rounds each weight to the bfloat16 the dense model holds: the
    same greedy tokens as the dequantized checkpoint loaded dense (desc_act's reordered
    columns and float32-scaled blocks included)."""
    quantized, dense = tmp_path / "q", tmp_path / "dense"
    ref, _ = _build(quantized, "gptq-asym-g64-desc_act", dense_copy=dense)
    assert _greedy(quantized, "bfloat16", ref.prompts) == _greedy(dense, "bfloat16",
                                                                   ref.prompts)


def _unpacked(fmt: str, group: int, sym: bool, desc_act: bool):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=gen) / 10
    g_idx = None
    if desc_act:
        g_idx = torch.empty(128, dtype=torch.int64)
        g_idx[torch.randperm(128, generator=gen)] = torch.arange(128) // group
    scale_dtype = torch.bfloat16 if fmt == "ct" else torch.float16
    q = quantize(w, group, sym, scale_dtype, g_idx)
    tensors = {"gptq": lambda: gptq_tensors(q), "gptq_v2": lambda: gptq_tensors(q, v1=False),
               "awq": lambda: awq_tensors(q), "ct": lambda: ct_tensors(q, sym)}[fmt]()
    method = {"gptq_v2": "gptq", "ct": "compressed-tensors"}.get(fmt, fmt)
    module = ModuleTensors("m", tensors.get, (48, 128), WeightScheme(4, group, sym), method)
    unpack = {"gptq": lambda t: unpack_gptq(t, True), "gptq_v2": lambda t: unpack_gptq(t, False),
              "awq": unpack_awq, "ct": unpack_compressed}[fmt]
    return q, unpack(module)


@needs_kernels
@pytest.mark.parametrize("fmt, group, sym, desc_act", [
    ("gptq", 32, True, False), ("gptq", 64, False, True), ("gptq_v2", 128, False, False),
    ("awq", 64, False, False), ("ct", 32, True, False), ("ct", -1, False, False),
])
def test_blocks_hold_the_dequantized_weights_exactly(fmt, group, sym, desc_act):
    """The kernels' own reading of the repacked blocks is the checkpoint's float32 weight
    exactly (columns in the blocks' order where g_idx reorders them)."""
    q, unpacked = _unpacked(fmt, group, sym, desc_act)
    blocks, half = to_blocks(unpacked, "m")
    assert half == sym  # an asymmetric zero point's min -s * z is no fp16
    assert (blocks.perm is not None) == desc_act
    expected = q.dequantized()
    if desc_act:
        expected = expected[:, blocks.perm]
    for block in (blocks, to_half(blocks)) if half else (blocks,):
        dense = kernels().dequantize_blocks(block.blocks, block.kind)
        assert torch.equal(dense, expected)


@needs_kernels
def test_half_layout_is_gguf_q4_1_repacked():
    """The fp16 layout is byte for byte what the kernels make of a GGUF Q4_1 block (d, m,
    then weight j in the low nibble of byte j, j + 16 in its high one) holding the same
    numbers: the GGUF path's layout, not a new one."""
    q, unpacked = _unpacked("gptq", 32, True, False)
    ours = to_half(to_blocks(unpacked, "m")[0])
    d = q.scale.float()  # [48, 4]: one group per block
    m = -(d * q.zero.float())
    codes = q.codes.view(48, 4, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    dm = torch.stack([d, m], -1).half().view(torch.uint8).reshape(48, 4, 4)
    gguf = torch.cat([dm, qs], -1).reshape(48, -1).contiguous()
    assert torch.equal(kernels().pack_blocks(gguf, BLOCK_KINDS["Q4_1"], -1), ours.blocks)
    assert ours.kind == HALF_KIND != FLOAT_KIND


def test_groups_that_split_a_block_refused():
    _, unpacked = _unpacked("gptq", 16, True, False)
    with pytest.raises(ValueError, match="m: its quantization groups do not fill whole 32-"):
        to_blocks(unpacked, "m")


# --- refusals: one line at start, naming what was found ------------------------------------------


@pytest.fixture(scope="module")
def gptq_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gptq")
    _build(path, "gptq-sym-g32")
    return path


def _edit_tensors(folder, edit) -> None:
    file = str(folder / "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _drop(name):
    return lambda t: t.pop(name)


def _misshape(name):
    return lambda t: t.update({name: t[name][:-1]})


Q = "model.layers.0.self_attn.q_proj"
QUANT = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True}
REFUSALS = {
    "8 bits": (dict(quantization_config=QUANT | {"bits": 8}), None, "gptq with 8 bits"),
    "unknown method": (dict(quantization_config={"quant_method": "fp8"}), None,
                       "quant_method 'fp8' is not run here"),
    "awq gemv": (dict(quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32,
                                           "version": "gemv"}), None, "only the GEMM layout"),
    "ct int-quantized": (dict(quantization_config={
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8}}}}), None,
        "format 'int-quantized'"),
    "missing scales": (None, _drop(f"{Q}.scales"), f"gptq checkpoint lacks {Q}.scales"),
    "misshapen qweight": (None, _misshape(f"{Q}.qweight"), f"{Q}.qweight has shape"),
    "stray tensor": (None, lambda t: t.update({"model.layers.0.mlp.gate.qweight":
                                               t[f"{Q}.qweight"].clone()}), "unexpected quantized"),
}


@needs_kernels
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_in_one_line(gptq_folder, tmp_path, case):
    config, edit, match = REFUSALS[case]
    folder = shutil.copytree(gptq_folder, tmp_path / "m")
    if config:
        rewrite_config(str(folder), **config)
    if edit:
        _edit_tensors(folder, edit)
    with pytest.raises(SystemExit, match=match) as refused:
        build_engine(_config(folder))
    assert "\n" not in str(refused.value)


@needs_kernels
@pytest.mark.parametrize("quantization, match", [
    ("awq", "--quantization awq: the checkpoint is gptq"),
    ("gptq_marlin", None),  # vLLM's name for the same checkpoints: agrees
])
def test_quantization_override_must_agree(gptq_folder, quantization, match):
    if match is None:
        assert build_engine(_config(gptq_folder, quantization=quantization)).runner.model
        return
    with pytest.raises(SystemExit, match=match):
        build_engine(_config(gptq_folder, quantization=quantization))


@pytest.mark.parametrize("flags, expected", [([], None), (["-q", "awq_marlin"], "awq_marlin"),
                                             (["--quantization", "gptq"], "gptq")])
def test_serve_passes_the_override_to_its_engine(monkeypatch, flags, expected):
    engine_argv, _ = serve_argvs(monkeypatch, flags)
    assert engine_config(parse_args(engine_argv), "ipc:///x").quantization == expected


def test_override_on_a_dense_checkpoint_refused(tmp_path):
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="has no quantization_config"):
        build_engine(_config(tmp_path, quantization="gptq"))


@pytest.mark.parametrize("quantization, refused", [(None, False), ("gguf", False),
                                                    ("gptq", True)])
def test_gguf_file_takes_only_gguf(quantization, refused):
    config = _config("model.gguf", quantization=quantization)
    check = functools.partial(_check_quantized, config, torch.device("cpu"), torch.float32,
                              None, None)
    if not refused:
        check()  # returns before reading anything: the file's blocks say the rest
        return
    with pytest.raises(SystemExit, match="--quantization gptq: model.gguf is a GGUF file"):
        check()


def test_without_the_kernels_refused(gptq_folder, monkeypatch):
    monkeypatch.setenv("SLUICE_CPU_KERNELS", "0")
    with pytest.raises(SystemExit, match="run in place on the CPU kernels only"):
        build_engine(_config(gptq_folder))


def test_engine_process_refuses_a_mismatch_in_one_line(gptq_folder):
    """`sluice engine -q awq` on a GPTQ folder: the process exits with one error line."""
    done = subprocess.run(
        [sys.executable, "-m", "sluice", "engine", "--model", str(gptq_folder), "-q", "awq",
         "--engine-address", "tcp://127.0.0.1:0", "--dtype", "float32"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "--quantization awq" in line]
    assert len(errors) == 1 and "the checkpoint is gptq" in errors[0]
    assert "Traceback" not in done.stderr


@needs_kernels
def test_lora_on_a_quantized_base(tmp_path):
    """QLoRA's serving side: a PEFT adapter over the 4-bit base (desc_act's reordered inputs
    included) gives the tokens of transformers' merged model over the dequantized weights."""
    import peft

    quantized, dense = tmp_path / "q", tmp_path / "dense"
    ref, _ = _build(quantized, "gptq-asym-g64-desc_act", dense_copy=dense)
    base = transformers.LlamaForCausalLM.from_pretrained(dense, torch_dtype=torch.float32)
    torch.manual_seed(1)
    lora = peft.get_peft_model(base, peft.LoraConfig(
        init_lora_weights=False, lora_dropout=0.0, r=4, lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    merged = lora.merge_and_unload().eval()
    core = build_engine(_config(quantized))
    manager = LoraManager(core.runner.model, 1, 16, 0)
    core.lora, core.runner.lora_ops, core.scheduler.max_loras = manager, manager.ops, 1
    manager.load(LoraAdapterInfo("a", str(tmp_path / "adapter")))
    prompts = ref.prompts[:2]
    for i, prompt in enumerate(prompts):
        core.add(EngineRequest(
            request_id=f"r{i}", prompt_token_ids=pack_ids(prompt), reply_to="tcp://test",
            params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            arrival_time=0.0, lora_name="a"))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for _, out in core.step():
            assert out.error is None, out.error
            tokens[out.request_id].extend(unpack_ids(out.new_token_ids).tolist())
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            out = merged.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=8, eos_token_id=None, pad_token_id=0)
            assert tokens[f"r{i}"] == out[0, len(prompt):].tolist(), f"prompt {i}"
    # The adapter changed something: these are not the base model's tokens.
    assert any(tokens[f"r{i}"] != ref.tokens[i][:8] for i in range(len(prompts)))
