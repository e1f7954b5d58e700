"""Which attention backend an engine runs: from the device, the dtype and the
`--attention-backend` flag (auto | torch | flashinfer).

auto picks flashinfer on a CUDA device where flashinfer imports and the dtype is 16-bit,
and torch everywhere else, with the reason, which the engine logs. Asking for flashinfer
where it cannot run is an error that says why, never a silent fallback. flashinfer is only
imported when the device is CUDA.
"""

from __future__ import annotations

import msgspec
import torch

from engine.layers.config import ModelConfig
from engine.layers.flashinfer_ops import flashinfer_import_error

BACKENDS = ("auto", "torch", "flashinfer")


class BackendUnavailable(ValueError):
    """The requested attention backend cannot run here; the message says why."""


class BackendChoice(msgspec.Struct, frozen=True):
    name: str  # "torch" | "flashinfer"
    reason: str


def flashinfer_unavailable(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """None when the flashinfer backend can run on this device and dtype; else why not."""
    if device.type != "cuda":
        return f"flashinfer needs a CUDA device and this engine runs on {device}"
    if not torch.cuda.is_available():
        return "torch sees no usable CUDA device"
    error = flashinfer_import_error()
    if error is not None:
        return (
            f"flashinfer does not import ({error}); install it with the `cuda` extra "
            "(pip install 'sluice[cuda]', i.e. flashinfer-python)"
        )
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return (
            f"FlashInfer's attention kernels take float16 or bfloat16, not "
            f"{str(dtype).removeprefix('torch.')}; use --dtype bfloat16 (or auto)"
        )
    return None


def select_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype
) -> BackendChoice:
    if requested not in BACKENDS:
        raise BackendUnavailable(
            f"unknown attention backend {requested!r}; choose one of {', '.join(BACKENDS)}"
        )
    if requested == "torch":
        return BackendChoice("torch", "--attention-backend torch")
    why_not = flashinfer_unavailable(device, dtype)
    if requested == "flashinfer":
        if why_not is not None:
            raise BackendUnavailable(f"--attention-backend flashinfer cannot run: {why_not}")
        return BackendChoice("flashinfer", "--attention-backend flashinfer")
    if why_not is None:
        return BackendChoice("flashinfer", "auto: CUDA device with flashinfer installed")
    return BackendChoice("torch", f"auto: flashinfer skipped because {why_not}")


def for_model(choice: BackendChoice, model: ModelConfig) -> BackendChoice:
    """auto's choice revised for the model: MLA runs on the torch path (FlashInfer's MLA
    kernels are not wired in yet); an explicit --attention-backend flashinfer is refused at
    create_attention_backend."""
    if model.mla is not None and choice.name == "flashinfer" and choice.reason.startswith("auto"):
        return BackendChoice("torch", "auto: MLA (latent KV) runs on the torch backend; "
                             "FlashInfer's MLA kernels are not wired in yet")
    return choice


def _mla_backend(name, model: ModelConfig, num_pages, page_size, dtype, device,
                 batch_invariant):
    if name == "flashinfer":
        raise ValueError(f"{model.architecture} uses multi-head latent attention, which the "
                         "flashinfer backend does not serve yet; use --attention-backend torch")
    if batch_invariant:
        raise ValueError(f"--batch-invariant: {model.architecture}'s latent attention has no "
                         "batch-invariant kernel yet")
    from engine.attention.mla_backend import MlaAttentionBackend

    mla = model.mla
    return MlaAttentionBackend(model.num_layers, num_pages, page_size, mla.kv_lora_rank,
                               mla.qk_rope_head_dim, dtype, device)


def narrow_cache_refusal(name: str, model: ModelConfig) -> str | None:
    """Why backend `name` cannot store a narrow KV cache for this model; None: it can."""
    if model.mla is None and name != "flashinfer":
        return None
    what = "multi-head latent attention" if model.mla is not None else "the flashinfer backend"
    return (f"--kv-cache-dtype: {what} keeps its KV cache in --dtype only (narrow caches "
            "are wired on the torch backend); use --kv-cache-dtype auto"
            + ("" if model.mla is not None else " or --attention-backend torch"))


def create_attention_backend(
    name: str,
    model: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    batch_invariant: bool = False,
    kv=None,
):
    """kv: a KV cache narrower than dtype (engine.attention.kv_dtype), None: in dtype; only
    the torch backend stores one."""
    refused = narrow_cache_refusal(name, model) if kv is not None else None
    if refused is not None:
        raise ValueError(refused)
    if model.mla is not None:
        return _mla_backend(name, model, num_pages, page_size, dtype, device, batch_invariant)
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttentionBackend

        # One plan serves every layer: layers that attend differently (Gemma's sliding and
        # global ones) would need a plan each.
        kinds = set(model.layer_attention)
        if len(kinds) > 1 or any(kind.sinks or kind.chunk for kind in kinds):
            raise ValueError(
                f"{model.architecture} mixes sliding-window and global layers or uses "
                "attention sinks or chunked local attention, which the flashinfer backend "
                "does not plan yet; use --attention-backend torch")

        return FlashInferAttentionBackend(
            model.num_layers, num_pages, page_size, model.num_heads, model.num_kv_heads,
            model.head_dim, dtype, device, batch_invariant=batch_invariant,
            attention=model.attention_of(0),
        )
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.kernels.cpu_kernels import kernels

    return TorchAttentionBackend(
        model.num_layers, num_pages, page_size, model.num_kv_heads, model.head_dim, dtype, device,
        kernels=kernels() if device.type == "cpu" else None, batch_invariant=batch_invariant,
        layers=model.layer_attention, kv=kv,
    )
