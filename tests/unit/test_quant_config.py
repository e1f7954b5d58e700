"""config.json's quantization_config for the 4-bit formats (engine.layers.quant_config): what
each format's keys say, compressed-tensors' targets and ignore list, vLLM's --quantization
override against it, and every bound refused in one line."""

import json

import pytest

from engine.layers.quant_config import QuantScheme, WeightScheme, checkpoint_quantization
from engine.process.build import build_engine
from tests.unit.quant_builders import quant_config, rewrite_config
from tests.unit.test_quantized_checkpoints import Q, _build, _config, needs_kernels

# --- quantization_config: what is read, and each bound ----------------------------------------


def _scheme(tmp_path, quant):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    return checkpoint_quantization(str(tmp_path))


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
      "config_groups": {
          "attn": {"targets": ["re:.*self_attn\\..*"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
              "group_size": 64}},
          "rest": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "int", "symmetric": False, "strategy": "channel"}}}}


def test_compressed_tensors_targets_and_ignore(tmp_path):
    scheme = _scheme(tmp_path, CT)
    assert scheme.weights_of("model.layers.0.self_attn.q_proj") == WeightScheme(4, 64, True)
    assert scheme.weights_of("model.layers.0.mlp.up_proj") == WeightScheme(4, -1, False)
    assert scheme.weights_of("lm_head") is None


@pytest.mark.parametrize("quant, scheme", [
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False},
     QuantScheme("gptq", WeightScheme(4, -1, False), zero_plus_one=True)),
    ({"quant_method": "GPTQ", "bits": 4, "group_size": 1, "checkpoint_format": "gptq_v2"},
     QuantScheme("gptq", WeightScheme(4, 1, True))),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"},
     QuantScheme("awq", WeightScheme(4, 128, False))),
    ({"quant_method": "mxfp4"}, None),  # gpt-oss reads its own
])
def test_schemes_read(tmp_path, quant, scheme):
    assert _scheme(tmp_path, quant) == scheme


@pytest.mark.parametrize("quant, override, match", [
    ({"quant_method": "mxfp4"}, "mxfp4", None),  # gpt-oss's, named as vLLM names it
    ({"quant_method": "mxfp4"}, "gptq", "--quantization gptq: the checkpoint is mxfp4"),
    ({"quant_method": "awq", "bits": 4}, "awq_marlin", None),
    ({"quant_method": "awq", "bits": 4}, "fp8", "--quantization fp8: sluice runs gptq"),
])
def test_override_against_the_config(tmp_path, quant, override, match):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    if match is None:
        checkpoint_quantization(str(tmp_path), override)
        return
    with pytest.raises(ValueError, match=match):
        checkpoint_quantization(str(tmp_path), override)


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size 0: expected -1 or"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -2}, "group_size -2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": True}, "group_size True"),
    ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, "group_size '128'"),
    ({"quant_method": "gptq", "bits": 3}, "gptq with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "without zero points"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not run here"),
    (CT | {"config_groups": {}}, "has no config_groups"),
    (CT | {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    (CT | {"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "float", "strategy": "group", "group_size": 32}}}}, "type 'float'"),
    (CT | {"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "strategy": "tensor"}}}}, "strategy 'tensor'"),
    (CT | {"config_groups": {"g": {"targets": ["Linear"], "input_activations": {
        "num_bits": 8}, "weights": {"num_bits": 4, "strategy": "channel"}}}},
     "quantizes input_activations"),
    ([1], "not an object"),
])
def test_schemes_refused(tmp_path, quant, match):
    with pytest.raises(ValueError, match=match):
        _scheme(tmp_path, quant)


@needs_kernels
def test_ignored_module_stored_quantized_refused(tmp_path):
    ref_path = tmp_path / "ct"
    _build(ref_path, "ct-sym-g32")
    rewrite_config(str(ref_path), quantization_config=quant_config("compressed-tensors", 32,
                                                                   True) | {"ignore": [Q]})
    with pytest.raises(SystemExit, match=f"{Q} is stored quantized, but quantization_config "):
        build_engine(_config(ref_path))
