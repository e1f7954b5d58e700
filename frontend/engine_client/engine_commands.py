"""Operator commands every engine runs (`EngineCommand`: the torch profiler's start and
stop, a read of its energy counters, vLLM's prefix-cache reset), sent to each live engine
over its connection, as LoRA updates are (`lora_client`), and answered by op id
(`EngineCommandResult`)."""

from __future__ import annotations

import asyncio
import uuid

from frontend.engine_client.lora_client import LoraReplies
from shared.codec import encode
from shared.protocol import EngineCommand, EngineCommandResult

# Seconds to wait for an engine's answer. A stop writes the trace first, which takes
# seconds after a long profile; an energy read is at once (a frozen engine: the 503).
COMMAND_TIMEOUT_S = {"start_profile": 30.0, "stop_profile": 120.0, "read_energy": 5.0,
                     "reset_prefix_cache": 10.0}


class CommandReplies(LoraReplies):
    """EngineCommandResults by op id (the same futures as LoRA updates' answers)."""


async def run_on_engines(client, command: str) -> list[tuple[str, EngineCommandResult]]:
    """`command` on every live engine: (engine id, its answer; a 503 one for an engine that
    did not answer in time), in the engines' address order."""
    conns = sorted(client.live_engines(), key=lambda c: c.address)
    waiting = []
    for conn in conns:
        op_id = uuid.uuid4().hex
        waiting.append((conn, op_id, client.command_replies.expect(op_id)))
        await conn.dealer.send(encode(EngineCommand(op_id, command)))
    results = []
    for conn, op_id, future in waiting:
        try:
            result = await asyncio.wait_for(future, COMMAND_TIMEOUT_S[command])
        except TimeoutError:
            client.command_replies.forget(op_id)
            result = EngineCommandResult(op_id, 503, f"engine {conn.engine_id} did not "
                                         "answer in time")
        results.append((conn.engine_id, result))
    return results
