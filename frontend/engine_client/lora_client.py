"""The frontend's view of LoRA adapters: what the engines serve, and run-time updates.

The engines are the truth: each one's heartbeat (EngineStats.lora_adapters) lists the
adapters it serves, so a frontend started later, or one that did not make the change, sees
the same list. An update goes to every live engine as a LoraUpdate and waits for each
one's LoraUpdateResult (`LoraReplies`); placement sends a request for an adapter only to
an engine that lists it (`engines_with`).
"""

from __future__ import annotations

import asyncio
import uuid

from shared.codec import encode
from shared.protocol import LoraAdapterInfo, LoraUpdate, LoraUpdateResult

# Seconds to wait for every engine's answer to a load or unload.
UPDATE_TIMEOUT_S = 60.0


class LoraReplies:
    """LoraUpdateResults by op id, for the coroutine waiting on them."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future] = {}

    def expect(self, op_id: str) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._waiting[op_id] = future
        return future

    def deliver(self, result: LoraUpdateResult) -> None:
        future = self._waiting.pop(result.op_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def forget(self, op_id: str) -> None:
        self._waiting.pop(op_id, None)


def adapters(client) -> dict[str, LoraAdapterInfo]:
    """Every adapter a live engine serves, by name (the first engine's entry wins)."""
    found: dict[str, LoraAdapterInfo] = {}
    for conn in client.live_engines():
        for info in conn.stats.lora_adapters if conn.stats is not None else []:
            found.setdefault(info.name, info)
    return found


def lora_name_for(ctx, model: str | None) -> str | None:
    """The adapter a request's `model` names; None for the base model (or no model)."""
    if model is None or model == ctx.model_name or model in ctx.model_aliases:
        return None
    return model if model in adapters(ctx.client) else None


def engines_with(live: list, lora_name: str | None) -> list:
    """The engines a request may go to: those serving its adapter (all for the base)."""
    if lora_name is None:
        return live
    holding = [c for c in live if c.stats is not None
               and any(i.name == lora_name for i in c.stats.lora_adapters)]
    return holding or live  # none lists it (yet): the engine answers with a clear 404


async def update(client, action: str, name: str, path: str = "") -> list[LoraUpdateResult]:
    """Send one load/unload to every live engine; their answers (a 503 result for one that
    did not answer in time). The engines' next heartbeats list the change."""
    conns = client.live_engines()
    futures = []
    for conn in conns:
        op_id = uuid.uuid4().hex
        futures.append((op_id, client.lora_replies.expect(op_id)))
        await conn.dealer.send(encode(LoraUpdate(op_id, action, name, path)))
    results = []
    for op_id, future in futures:
        try:
            results.append(await asyncio.wait_for(future, UPDATE_TIMEOUT_S))
        except TimeoutError:
            client.lora_replies.forget(op_id)
            results.append(LoraUpdateResult(op_id, 503, "an engine did not answer in time"))
    await client.refresh_stats()  # so /v1/models shows the change at once
    return results
