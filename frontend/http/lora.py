"""LoRA adapters over HTTP: which adapter a request's `model` names, the adapters' model
cards, and vLLM's run-time routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(registered only with --allow-runtime-lora-updating, behind the same auth as every route).

Answers follow vLLM's: 200 with a plain-text "Success: ..." line; 400 for a missing field
or a name loaded twice (or an adapter the engine refuses, with its reason); 404 for an
unload of an unknown name or a path with no adapter.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from frontend.base.errors import APIError
from frontend.engine_client import lora_client
from postproc.openai_shapes import ModelCard


class LoadLoraAdapterRequest(msgspec.Struct):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoraAdapterRequest(msgspec.Struct):
    lora_name: str | None = None
    lora_int_id: int | None = None  # vLLM's alternative key; names are what sluice keys by


MAX_NAME_CHARS = 1024  # the engine's bound on lora_name too


def lora_cards(ctx, max_model_len: int) -> list[ModelCard]:
    """vLLM's cards for adapters: `root` the adapter's folder, `parent` its base model."""
    return [ModelCard(id=info.name, created=ctx.started, max_model_len=max_model_len,
                      root=info.path, parent=info.base_model_name or ctx.model_name)
            for info in lora_client.adapters(ctx.client).values()]


def _checked_name(name: str | None, what: str) -> str:
    if not name:
        raise APIError(400, what)
    if len(name) > MAX_NAME_CHARS:
        raise APIError(400, f"'lora_name' may have at most {MAX_NAME_CHARS} characters",
                       "lora_name")
    return name


async def _apply(ctx, action: str, name: str, path: str = "") -> None:
    if not ctx.client.live_engines():
        raise APIError(503, "No engine is available; try again shortly.")
    results = await lora_client.update(ctx.client, action, name, path)
    failed = [r for r in results if r.status != 200]
    if failed:
        raise APIError(failed[0].status, failed[0].message)


def routes(ctx, decode):
    """The two handlers, for app.py to register. `decode(request, type)`: the app's body
    decoder (media type, depth and validation errors as 400s)."""

    async def load_lora_adapter(request: Request) -> Response:
        body = await decode(request, LoadLoraAdapterRequest)
        if not body.lora_name or not body.lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        name = _checked_name(body.lora_name, "")
        if (name in lora_client.adapters(ctx.client) or name == ctx.model_name
                or name in ctx.model_aliases):
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           "lora_name")
        await _apply(ctx, "load", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: Request) -> Response:
        body = await decode(request, UnloadLoraAdapterRequest)
        name = _checked_name(body.lora_name,
                             "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in lora_client.adapters(ctx.client):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        await _apply(ctx, "unload", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return load_lora_adapter, unload_lora_adapter
