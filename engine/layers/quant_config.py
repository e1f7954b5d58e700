"""config.json's `quantization_config` for the 4-bit safetensors formats the CPU kernels run
in place (GPTQ, AWQ GEMM, compressed-tensors pack-quantized), and vLLM's `--quantization`
override checked against it. Anything else is refused in one line naming what was found.

The tensors themselves are read by engine.layers.quant_formats; this module only says which
format a checkpoint is in and with which parameters."""

from __future__ import annotations

import json
import os
import re

import msgspec

# vLLM's --quantization names -> the method they ask for (the marlin ones are vLLM's CUDA
# kernels for the same checkpoints).
OVERRIDE_METHODS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                    "compressed-tensors": "compressed-tensors", "gguf": "gguf",
                    "mxfp4": "mxfp4"}
# Methods a family reads itself (gpt-oss's MXFP4 experts): not this module's.
FAMILY_METHODS = ("mxfp4",)
RUN_BITS = 4


class WeightScheme(msgspec.Struct, frozen=True):
    """How one module's weight is quantized."""

    bits: int
    group_size: int  # -1: one group over the whole input (per output channel)
    symmetric: bool


class CtGroup(msgspec.Struct, frozen=True):
    """A compressed-tensors config group: which modules it takes, and how."""

    targets: tuple[str, ...]  # class names ("Linear") or "re:<regex>" on the module name
    weights: WeightScheme


class QuantScheme(msgspec.Struct, frozen=True):
    method: str  # gptq | awq | compressed-tensors
    default: WeightScheme | None = None  # gptq, awq: every quantized module's
    zero_plus_one: bool = False  # GPTQ v1 checkpoints store each zero point less one
    groups: tuple[CtGroup, ...] = ()  # compressed-tensors
    ignore: tuple[str, ...] = ()  # compressed-tensors: module names or "re:" patterns

    def weights_of(self, module: str) -> WeightScheme | None:
        """The scheme of `module` (an HF module name), None where the config leaves it
        unquantized."""
        if self.default is not None:
            return self.default
        if any(_matches(pattern, module) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(target, module) for target in group.targets):
                return group.weights
        return None


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    # A class name: every module this loader quantizes is a Linear.
    return target == "Linear" or module == target or module.endswith("." + target)


def checkpoint_quantization(folder: str, override: str | None = None) -> QuantScheme | None:
    """The scheme of the safetensors folder's config.json (None: not quantized, or a method
    its family reads itself); `override`: --quantization, which must agree with it."""
    config = {}
    path = os.path.join(folder, "config.json")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            config = json.load(f)
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if override is not None and override not in OVERRIDE_METHODS:
        raise ValueError(f"--quantization {override}: sluice runs "
                         f"{', '.join(OVERRIDE_METHODS)}")
    if quant is None:
        if override is not None:
            raise ValueError(f"--quantization {override}: the checkpoint's config.json has no "
                             "quantization_config")
        return None
    if not isinstance(quant, dict):
        raise ValueError("config.json's quantization_config is not an object")
    method = str(quant.get("quant_method", "")).lower()
    if override is not None and OVERRIDE_METHODS[override] != method:
        raise ValueError(f"--quantization {override}: the checkpoint is {method or 'unnamed'} "
                         "(config.json's quantization_config.quant_method)")
    if method in FAMILY_METHODS:
        return None
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}
    if method not in readers:
        raise ValueError(f"quantization_config.quant_method {method!r} is not run here: "
                         "gptq, awq (GEMM) and compressed-tensors pack-quantized, 4-bit")
    return readers[method](quant)


def _bits(method: str, bits) -> int:
    if bits != RUN_BITS:
        raise ValueError(f"{method} with {bits} bits is not run here: only {RUN_BITS}-bit")
    return bits


def _group_size(method: str, size) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
        raise ValueError(f"{method} group_size {size!r}: expected -1 or a positive integer")
    return size


def _gptq(quant: dict) -> QuantScheme:
    bits = _bits("gptq", quant.get("bits"))
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {fmt!r} is not run here: gptq or gptq_v2")
    if quant.get("dynamic"):
        raise ValueError("gptq's per-module 'dynamic' overrides are not run here")
    scheme = WeightScheme(bits, _group_size("gptq", quant.get("group_size", 128)),
                          bool(quant.get("sym", True)))
    return QuantScheme("gptq", scheme, zero_plus_one=fmt == "gptq")


def _awq(quant: dict) -> QuantScheme:
    bits = _bits("awq", quant.get("bits", quant.get("w_bit")))
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not run here: only the GEMM layout")
    if not quant.get("zero_point", True):
        raise ValueError("awq without zero points is not run here")
    size = _group_size("awq", quant.get("group_size", quant.get("q_group_size", 128)))
    return QuantScheme("awq", WeightScheme(bits, size, False))


def _compressed_tensors(quant: dict) -> QuantScheme:
    fmt = quant.get("format")
    groups = []
    for name, group in (quant.get("config_groups") or {}).items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ValueError(f"compressed-tensors config group {name!r} has no weights")
        group_format = group.get("format") or fmt
        if group_format != "pack-quantized":
            raise ValueError(f"compressed-tensors format {group_format!r} (group {name!r}) is "
                             "not run here: only pack-quantized int4")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise ValueError(f"compressed-tensors group {name!r} quantizes {key}: "
                                 "not run here (weight-only int4)")
        groups.append(CtGroup(tuple(group.get("targets") or ()), _ct_weights(name,
                                                                            group["weights"])))
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if quant.get("kv_cache_scheme"):
        raise ValueError("compressed-tensors kv_cache_scheme is not run here")
    if quant.get("sparsity_config"):
        raise ValueError("compressed-tensors sparsity_config is not run here")
    return QuantScheme("compressed-tensors", groups=tuple(groups),
                       ignore=tuple(quant.get("ignore") or ()))


def _ct_weights(name: str, weights: dict) -> WeightScheme:
    if weights.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors group {name!r} weights of type "
                         f"{weights.get('type')!r}: only int")
    bits = _bits("compressed-tensors", weights.get("num_bits"))
    strategy = weights.get("strategy")
    if strategy == "channel":
        size = -1
    elif strategy == "group":
        size = _group_size("compressed-tensors", weights.get("group_size"))
    else:
        raise ValueError(f"compressed-tensors group {name!r} strategy {strategy!r} is not run "
                         "here: group or channel")
    return WeightScheme(bits, size, bool(weights.get("symmetric", True)))
