"""--kv-cache-dtype: the KV cache stored narrower than the engine's dtype, as vLLM's flag.

auto keeps the engine's dtype. bfloat16 / float16 store the cache in that 16-bit type (a
float32 engine's cache in half the memory). fp8 (= fp8_e4m3: torch.float8_e4m3fn), fp8_e5m2
and int8 store one byte an element with one scale per layer for K and one for V:
stored = x / scale (int8: rounded, clipped to +-127; fp8: clipped to the type's largest),
read back as stored * scale in the engine's dtype.

The scales are the checkpoint's where it has them (vLLM's names: `...self_attn.k_scale` and
`...self_attn.v_scale`, or one `...self_attn.kv_scale` for both). Else fixed ones: 1.0 for
fp8, as vLLM (e4m3 rounds to within 2^-4 relative anywhere in [2^-6, 448], e5m2 to 2^-3
from 2^-14 to 57344, and the keys and values of the models served here stay far inside both). int8's
step is one fixed size a layer, so the engine computes its scales at start from one prefill
of a fixed text (engine.attention.kv_calibration); INT8_SCALES (keys 0.25: +-31.75, values
0.1: +-12.7, from SmolLM2-135M's largest key ~21 and value ~11) are the fallback where that
cannot run, and what a backend built without the engine gets.
"""

from __future__ import annotations

import glob
import os
import re

import msgspec
import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")

_STORED = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
}
ONE_BYTE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
INT8_SCALES = (0.25, 0.1)  # keys, values (see the module's docstring)
_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


class KvCacheDtype(msgspec.Struct, frozen=True):
    """How a cache narrower than the engine's dtype is stored: its dtype and each layer's
    K and V scales (1.0 for the 16-bit types)."""

    dtype: object  # torch.dtype of the stored elements
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    source: str  # where the scales came from, for the log line

    @property
    def one_byte(self) -> bool:
        return self.dtype in ONE_BYTE


def stored_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache's elements are stored in (ValueError for an unknown name)."""
    if name == "auto":
        return model_dtype
    if name not in _STORED:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return _STORED[name]


def kv_cache_dtype(name: str, model_dtype: torch.dtype, num_layers: int,
                   model_path: str | None = None) -> KvCacheDtype | None:
    """The narrow cache --kv-cache-dtype asks for, or None where it is the engine's dtype."""
    dtype = stored_dtype(name, model_dtype)
    if dtype == model_dtype:
        return None
    if dtype not in ONE_BYTE:
        return KvCacheDtype(dtype, (1.0,) * num_layers, (1.0,) * num_layers, "16-bit: none")
    found = checkpoint_scales(model_path, num_layers) if model_path else None
    if found is not None:
        return KvCacheDtype(dtype, *found, "the checkpoint's k_scale / v_scale")
    k, v = INT8_SCALES if dtype == torch.int8 else (1.0, 1.0)
    return KvCacheDtype(dtype, (k,) * num_layers, (v,) * num_layers,
                        f"fixed: K {k}, V {v} (the checkpoint has none)")


def checkpoint_scales(folder: str, num_layers: int) -> tuple[tuple, tuple] | None:
    """Each layer's (k_scales, v_scales) from a safetensors folder's k_scale / v_scale (or
    kv_scale) tensors; None where it has none. A layer missing one: ValueError."""
    if not os.path.isdir(folder):
        return None  # a .gguf file carries no KV scales
    from safetensors import safe_open

    k, v = {}, {}
    for shard in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                match = _SCALE_NAME.search(name)
                if match is None:
                    continue
                layer, kind = int(match.group(1)), match.group(2)
                value = float(f.get_tensor(name).float().reshape(-1)[0])
                if value <= 0 or value != value:
                    raise ValueError(f"{name} is {value}: a KV scale must be positive")
                if kind in ("k_scale", "kv_scale"):
                    k[layer] = value
                if kind in ("v_scale", "kv_scale"):
                    v[layer] = value
    if not k and not v:
        return None
    missing = [i for i in range(num_layers) if i not in k or i not in v]
    if missing:
        raise ValueError(f"the checkpoint has KV scales for some layers but not for layer "
                         f"{missing[0]} (model.layers.{missing[0]}.self_attn.k_scale / v_scale)")
    return tuple(k[i] for i in range(num_layers)), tuple(v[i] for i in range(num_layers))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: x / scale in `dtype`, clipped to its range (fp8's
    conversion would give NaN or inf past it), int8 rounded to nearest."""
    if dtype in (torch.bfloat16, torch.float16):
        limit = torch.finfo(dtype).max
        return x.clamp(-limit, limit).to(dtype)
    y = x.to(torch.float32) / scale
    if dtype == torch.int8:
        return y.round_().clamp_(-127, 127).to(torch.int8)
    limit = torch.finfo(dtype).max
    return y.clamp_(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What `quantize` stored, back in the engine's dtype: stored * scale."""
    wide = stored.to(dtype)
    return wide if scale == 1.0 else wide.mul_(scale)
