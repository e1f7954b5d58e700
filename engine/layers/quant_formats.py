"""One quantized linear of a GPTQ, AWQ (GEMM) or compressed-tensors (pack-quantized) 4-bit
checkpoint -> the block layout the CPU kernels multiply (engine/kernels/csrc/cpu_kernels.cpp,
the layouts GGUF's Q4_1 and Q4_K repack into): per 32 input weights a scale d, a min m and
32 nibbles, w = d * q + m. A group's scale s and zero point z give d = s, m = -s * z for each
of its 32-weight blocks, so any group size that fills whole blocks maps exactly; the columns
of a GPTQ `desc_act` checkpoint (g_idx) are reordered so each group's are contiguous, and the
activations are gathered in that order at run time (QuantizedWeight.perm).

Each format's tensors, as written by AutoGPTQ, AutoAWQ and compressed-tensors:
  gptq: qweight int32 [in/8, out] (nibble j of word i: input 8i+j), qzeros int32
        [groups, out/8] (nibble j: output 8c+j; v1 stores zero - 1), scales [groups, out],
        g_idx int32 [in] (each input's group).
  awq:  qweight int32 [in, out/8] and qzeros [groups, out/8], nibble i of word c holding
        output 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; scales [groups, out]; group = input // size.
  compressed-tensors: weight_packed int32 [out, in/8] (nibble j: input 8c+j, stored q + 8),
        weight_scale [out, groups], weight_shape [2], weight_zero_point int32
        [out/8, groups] (packed along the outputs, stored z + 8) where asymmetric,
        weight_g_idx [in] where activation-ordered.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import torch

from engine.layers.gguf_weights import BLOCK_KINDS, QuantizedWeight
from engine.layers.quant_config import WeightScheme

BLOCK = 32  # the kernels' weights per scale
PACK = 8  # 4-bit values per int32 word
HALF_KIND = BLOCK_KINDS["Q4_1"]  # fp16 d and m: 20 bytes a block
FLOAT_KIND = BLOCK_KINDS["Q4_K"]  # float32 d and m: 24 bytes a block
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_UNDO = np.argsort(_AWQ_ORDER).tolist()

# Each format's tensor suffixes (after the module's name), the ones it cannot do without first.
SUFFIXES = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_shape",
                           "weight_zero_point", "weight_g_idx"),
}


class Unpacked(msgspec.Struct):
    """A quantized linear in the checkpoint's numbers: w[o, i] = scale[o, g] * (codes[o, i]
    - zero[o, g]) with g = group_of[i]."""

    codes: torch.Tensor  # uint8 [out, in], 0..15
    scale: torch.Tensor  # float32 [out, groups]
    zero: torch.Tensor  # float32 [out, groups]
    group_of: torch.Tensor  # int64 [in]


def nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 4-bit values (0..15), word c's nibble j at 8c + j along `dim`.
    In bytes (little-endian: byte b holds nibbles 2b and 2b + 1), a quarter of the work
    of shifting int32s."""
    rows, cols = words.shape
    # (flattened first: a [n, 1] column sliced from a wider tensor counts as contiguous
    # while its last stride is not 1, which a view as bytes refuses)
    data = words.contiguous().reshape(-1).view(torch.uint8).view(rows, cols, 4)
    values = torch.stack([data & 0xF, data >> 4], dim=-1).view(rows, cols, 8)
    if dim == 1:
        return values.reshape(rows, cols * 8)
    return values.permute(0, 2, 1).reshape(rows * 8, cols)


class ModuleTensors:
    """One module's stored tensors, read on demand, with the checks that name them."""

    def __init__(self, module: str, get: Callable[[str], torch.Tensor | None],
                 shape: tuple[int, int], scheme: WeightScheme, method: str) -> None:
        self.module, self._get, self.scheme, self.method = module, get, scheme, method
        self.out, self.inp = shape
        size = scheme.group_size
        self.groups = 1 if size == -1 else -(-self.inp // size)

    def get(self, suffix: str, shape: tuple[int, ...] | None, dtypes=None,
            required: bool = True) -> torch.Tensor | None:
        tensor = self._get(suffix)
        name = f"{self.module}.{suffix}"
        if tensor is None:
            if required:
                raise ValueError(f"{self.method} checkpoint lacks {name}")
            return None
        if shape is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                             f"({self._what()})")
        if dtypes is not None and tensor.dtype not in dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise ValueError(f"{name} is {str(tensor.dtype).removeprefix('torch.')}, "
                             f"expected {names}")
        return tensor

    def _what(self) -> str:
        return (f"a [{self.out}, {self.inp}] weight, {self.scheme.bits}-bit, group size "
                f"{self.scheme.group_size}")

    def scales(self, shape: tuple[int, int]) -> torch.Tensor:
        scale = self.get(self._scale_suffix(), shape, (torch.float16, torch.bfloat16,
                                                       torch.float32))
        return scale.to(torch.float32)

    def _scale_suffix(self) -> str:
        return "weight_scale" if self.method == "compressed-tensors" else "scales"

    def sequential_groups(self) -> torch.Tensor:
        size = self.inp if self.scheme.group_size == -1 else self.scheme.group_size
        return torch.arange(self.inp) // size

    def g_idx(self, suffix: str) -> torch.Tensor:
        g_idx = self.get(suffix, (self.inp,), (torch.int32, torch.int64), required=False)
        if g_idx is None:
            return self.sequential_groups()
        g_idx = g_idx.to(torch.int64)
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= self.groups):
            raise ValueError(f"{self.module}.{suffix} names groups outside 0..{self.groups - 1}")
        return g_idx


def unpack_gptq(t: ModuleTensors, zero_plus_one: bool) -> Unpacked:
    out, inp, groups = t.out, t.inp, t.groups
    words = (torch.int32,)
    codes = nibbles(t.get("qweight", (-(-inp // PACK), out), words), 0)[:inp].T
    zeros = nibbles(t.get("qzeros", (groups, -(-out // PACK)), words), 1)[:, :out]
    if zero_plus_one:  # v1: zero - 1 stored, wrapping to 4 bits (AutoGPTQ's own reading)
        zeros = (zeros + 1) & 0xF
    scale = t.scales((groups, out)).T
    return Unpacked(codes.contiguous(), scale.contiguous(), zeros.T.to(torch.float32),
                    t.g_idx("g_idx"))


def unpack_awq(t: ModuleTensors) -> Unpacked:
    out, inp, groups = t.out, t.inp, t.groups
    words = (torch.int32,)

    def columns(stored: torch.Tensor) -> torch.Tensor:  # undo the interleaved nibble order
        values = nibbles(stored, 1)
        return values.view(values.shape[0], -1, PACK)[:, :, _AWQ_UNDO].reshape(
            values.shape[0], -1)[:, :out]

    if out % PACK:
        raise ValueError(f"{t.module}: awq packs outputs 8 to a word; {out} is no multiple")
    codes = columns(t.get("qweight", (inp, out // PACK), words)).T
    zeros = columns(t.get("qzeros", (groups, out // PACK), words)).T
    scale = t.scales((groups, out)).T
    return Unpacked(codes.contiguous(), scale.contiguous(), zeros.to(torch.float32),
                    t.sequential_groups())


def unpack_compressed(t: ModuleTensors) -> Unpacked:
    out, inp, groups = t.out, t.inp, t.groups
    stored = t.get("weight_shape", (2,), (torch.int32, torch.int64))
    if tuple(stored.tolist()) != (out, inp):
        raise ValueError(f"{t.module}.weight_shape is {tuple(stored.tolist())}, expected "
                         f"{(out, inp)}")
    codes = nibbles(t.get("weight_packed", (out, -(-inp // PACK)), (torch.int32,)), 1)[:, :inp]
    scale = t.scales((out, groups))
    if t.scheme.symmetric:
        zero = torch.full((out, groups), 8.0)  # codes are q + 8, q symmetric around 0
    else:
        packed = t.get("weight_zero_point", (-(-out // PACK), groups), (torch.int32,))
        zero = nibbles(packed, 0)[:out].to(torch.float32)  # stored z + 8, as the codes
    return Unpacked(codes.contiguous(), scale.contiguous(), zero, t.g_idx("weight_g_idx"))


def to_blocks(u: Unpacked, module: str) -> tuple[QuantizedWeight, bool]:
    """The kernels' float32-scale layout (FLOAT_KIND) of `u`, and whether every d and m is
    an fp16 value (then `to_half` gives the narrower layout, the same numbers)."""
    out, inp = u.codes.shape
    if inp % BLOCK:
        raise ValueError(f"{module}: {inp} inputs; the CPU kernels take multiples of {BLOCK}")
    order = torch.argsort(u.group_of, stable=True)
    groups = u.group_of[order]
    perm = None if torch.equal(order, torch.arange(inp)) else order
    codes = u.codes if perm is None else u.codes[:, perm]
    by_block = groups.view(-1, BLOCK)
    if not torch.equal(by_block, by_block[:, :1].expand_as(by_block)):
        raise ValueError(f"{module}: its quantization groups do not fill whole {BLOCK}-weight "
                         f"blocks; the CPU kernels take group sizes that are multiples of "
                         f"{BLOCK}")
    block_group = by_block[:, 0]
    d = u.scale[:, block_group]
    m = -(d * u.zero[:, block_group])  # exact: an fp16/bf16 scale times an integer <= 16
    if not (torch.isfinite(d).all() and torch.isfinite(m).all()):
        raise ValueError(f"{module}: its scales are not all finite")
    nb = inp // BLOCK
    # Weight j = 8t + k of a block: nibble t of 16-bit word k (cpu_kernels.cpp q4_1_index),
    # so word k's low byte holds weights k and 8 + k, its high byte 16 + k and 24 + k.
    q = codes.reshape(out, nb, 4, 8)
    low, high = q[:, :, 0] | (q[:, :, 1] << 4), q[:, :, 2] | (q[:, :, 3] << 4)
    words = torch.stack([low, high], dim=-1).reshape(out, nb, 16)
    scales = torch.stack([d, m], dim=-1).contiguous().view(torch.uint8).reshape(out, nb, 8)
    blocks = torch.cat([scales, words], dim=-1).reshape(out, nb * 24).contiguous()
    half = torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)
    return QuantizedWeight(FLOAT_KIND, blocks, packed=True, perm=perm), half


def to_half(q: QuantizedWeight) -> QuantizedWeight:
    """The FLOAT_KIND blocks in HALF_KIND's layout (fp16 d and m: 20 bytes, not 24), for
    blocks whose d and m are all fp16 values (to_blocks said so)."""
    rows = q.blocks.shape[0]
    blocks = q.blocks.view(rows, -1, 24)
    dm = blocks[..., :8].contiguous().view(torch.float32).half().view(torch.uint8)
    half = torch.cat([dm, blocks[..., 8:]], dim=-1).reshape(rows, -1).contiguous()
    return QuantizedWeight(HALF_KIND, half, packed=True, perm=q.perm)


def dequantized(u: Unpacked) -> torch.Tensor:
    """The float32 weight `u` stands for (for tests and diagnostics)."""
    scale = u.scale[:, u.group_of]
    return scale * (u.codes.to(torch.float32) - u.zero[:, u.group_of])


UNPACKERS = {"gptq": unpack_gptq, "awq": unpack_awq, "compressed-tensors": unpack_compressed}
