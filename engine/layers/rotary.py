"""Rotary position embeddings: the cos/sin tables every family looks up per token, with the
frequency scalings checkpoints ask for (linear, llama3, YaRN, LongRoPE, and a GGUF file's
per-frequency divisors), computed as transformers' `modeling_rope_utils` does."""

from __future__ import annotations

import math

import torch

from engine.layers.config import ModelConfig, RopeScaling


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, looked up per token.

    theta / scaling: a layer kind's own rotary base and scaling where the config's top-level
    ones do not apply (Gemma 3's sliding layers)."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype, device,
                 theta: float | None = None, scaling: RopeScaling | None = None,
                 use_config_scaling: bool = True) -> None:
        dim = config.rotary_dim or config.head_dim
        theta = config.rope_theta if theta is None else theta
        if scaling is None and use_config_scaling:
            scaling = config.rope_scaling
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
        inv_freq = 1.0 / (theta**exponents)
        # Per position: LongRoPE switches to its long factors past the original length.
        freqs, self.attention_factor = _scaled_freqs(inv_freq, scaling, max_positions,
                                                     config, dim)
        self._freqs = freqs
        self.inv_freq = freqs[0] if freqs.dim() == 2 else freqs  # float32 (short factors)
        self.max_positions = max_positions
        t = torch.arange(max_positions, dtype=torch.int64).to(torch.float)
        angles = _angles(t, freqs)
        emb = torch.cat((angles, angles), dim=-1)
        self.cos = (emb.cos() * self.attention_factor).to(dtype).to(device)
        self.sin = (emb.sin() * self.attention_factor).to(dtype).to(device)

    def float32_cos_sin(self) -> torch.Tensor:
        """float32 [max_positions, rotary dims]: cos of each frequency, then sin (FlashInfer's
        cos/sin cache), from the float32 frequencies, scaled as the tables are."""
        t = torch.arange(self.max_positions, dtype=torch.int64).to(torch.float)
        angles = _angles(t, self._freqs)
        return torch.cat((angles.cos(), angles.sin()), dim=-1) * self.attention_factor

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [T, 1, head_dim]: looked up once per step
        and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]."""
        return self.rotate(x, *self.tables(positions))

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dim = cos.shape[-1]
        if dim < x.shape[-1]:  # partial rotary: the rest of each head passes unrotated
            turned = RotaryEmbedding.rotate(x[..., :dim], cos, sin)
            return torch.cat((turned, x[..., dim:]), dim=-1)
        half = dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def _angles(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Position x frequency angles; freqs [D/2], or [positions, D/2] per position."""
    return torch.outer(t, freqs) if freqs.dim() == 1 else t[:, None] * freqs[: len(t)]


def _scaled_freqs(inv_freq: torch.Tensor, scaling: RopeScaling | None, max_positions: int,
                  config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scale) under `scaling`."""
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, config, dim)
    if scaling.rope_type == "longrope":
        return _longrope_freqs(inv_freq, scaling, max_positions, config)
    if scaling.rope_type == "freq_factors":
        factors = torch.tensor(scaling.freq_factors, dtype=torch.float32)
        if factors.shape != inv_freq.shape or not bool((factors > 0).all()):
            raise ValueError(f"rope_freqs: {len(scaling.freq_factors)} factors for "
                             f"{len(inv_freq)} rotary frequencies, or one not positive")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, config: ModelConfig,
                   dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between
    (transformers' _compute_yarn_parameters)."""
    factor, base = scaling.factor, config.rope_theta
    original = scaling.original_max_position_embeddings

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = mscale(factor, scaling.mscale) / mscale(factor,
                                                                       scaling.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    interpolated = inv_freq / factor
    return interpolated * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _longrope_freqs(inv_freq: torch.Tensor, scaling: RopeScaling, max_positions: int,
                    config: ModelConfig) -> tuple[torch.Tensor, float]:
    """LongRoPE: frequencies divided by the short factors up to the original length and by
    the long ones past it, per position ([max_positions, D/2]); transformers switches a
    whole sequence to the long factors once it is longer, a difference only past the
    original length."""
    original = scaling.original_max_position_embeddings
    factor = scaling.factor or config.max_position_embeddings / original
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original)))
    short = inv_freq / torch.tensor(scaling.short_factor, dtype=torch.float32)
    long = inv_freq / torch.tensor(scaling.long_factor, dtype=torch.float32)
    positions = torch.arange(max_positions)[:, None]
    return torch.where(positions < original, short, long), float(attention_factor)
