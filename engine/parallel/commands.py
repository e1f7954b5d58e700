"""What rank 0 sends the other ranks, and how: a two-int header on the command group, then
the command's payload. One STEP per model step (its plan: every chunk's tokens, positions
and pages, so each rank builds the same attention metadata over its own KV cache; with a
VLM's image tokens in the step, their rows and embeddings follow on the compute group, as
only rank 0 holds the vision encoder; with LoRA, each chunk's adapter id), one
LOGITS per LM-head call (the hidden rows, gathered back as full-vocabulary logits), one
LORA per adapter loaded or removed on rank 0 (every rank reads its slice from the folder and
answers, so a rank that cannot read it fails the load, not the engine), STOP at the end.
Never anything per layer: inside a step the ranks meet only in the model's own all-reduces.

The command group (gloo, on the CPU) has no practical timeout: an idle engine sends
nothing for as long as it is idle. A step's collectives (the hidden rows, the image
embeddings, the model's own) run on the compute group, whose timeout (SLUICE_TP_TIMEOUT_S)
bounds a wait for a hung rank; a dead one is seen at once (its sockets close). Rank 0's
sends on the command group wait at most that long too (the other ranks wait for their next
command for as long as the engine is idle).
"""

from __future__ import annotations

import datetime

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from engine.step.lora_adapters import LoraChange

STEP, LOGITS, STOP, LORA = 1, 2, 3, 4
VERDICT_BYTES = 512  # a rank's answer to a LORA command: its error, cut to this
IDLE_TIMEOUT = datetime.timedelta(days=365)


class ChunkPlan(msgspec.Struct, array_like=True):
    """One scheduled chunk, as much of it as a rank's backend and model read."""

    request_id: str
    start: int
    num_tokens: int
    fed: list[int]  # the known tokens fed (then the draft)
    draft: list[int]
    pages: list[int]
    lora_id: int = 0  # its LoRA adapter's id (engine.step.lora_adapters); 0: the base model


class StepPlan(msgspec.Struct, array_like=True):
    chunks: list[ChunkPlan]
    embeds: int = 0  # image-token rows whose embeddings follow (a VLM's step)


class PlanSeq(msgspec.Struct):
    """The part of a Sequence the attention backends read."""

    request_id: str
    pages: list[int]


def plan_of(chunks, embeds: int = 0) -> bytes:
    out = []
    for c in chunks:
        known = c.start + c.num_tokens - len(c.draft)
        out.append(ChunkPlan(c.seq.request_id, c.start, c.num_tokens,
                             c.seq.token_ids[c.start:known], list(c.draft), list(c.seq.pages),
                             c.seq.lora_id))
    return msgspec.msgpack.encode(StepPlan(out, embeds))


_plan_decoder = msgspec.msgpack.Decoder(StepPlan)


def decode_plan(payload: bytes) -> StepPlan:
    return _plan_decoder.decode(payload)


_change_decoder = msgspec.msgpack.Decoder(LoraChange)


def decode_change(payload: bytes) -> LoraChange:
    return _change_decoder.decode(payload)


def verdicts(group, error: str, timeout: datetime.timedelta | None = None) -> list[str]:
    """Every rank's answer to a LORA command ("": done, else its error), on every rank;
    rank 0 waits at most `timeout` (a rank that hangs while reading)."""
    raw = error.encode()[:VERDICT_BYTES]
    buf = torch.zeros(VERDICT_BYTES, dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, buf, group=group, async_op=True)
    if timeout is None:  # a rank waits as long as rank 0 does (wait() takes no None)
        work.wait()
    else:
        work.wait(timeout=timeout)
    return [p.numpy().tobytes().rstrip(b"\0").decode(errors="replace") for p in parts]


def send_command(group, kind: int, n: int, payload: bytes = b"",
                 timeout: datetime.timedelta | None = None) -> None:
    """Rank 0: the header, then (STEP) the plan's bytes. gloo's broadcast waits for every
    rank to take part, so a rank that hangs while idle would hold rank 0 here for the
    group's (idle) timeout: rank 0 waits at most `timeout` instead (RuntimeError)."""
    header = torch.tensor([kind, n], dtype=torch.int64)
    dist.broadcast(header, 0, group=group, async_op=True).wait(timeout=timeout)
    if payload:
        data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        dist.broadcast(data, 0, group=group, async_op=True).wait(timeout=timeout)


def receive_command(group) -> tuple[int, int]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, 0, group=group)
    kind, n = header.tolist()
    return kind, n


def receive_payload(group, n: int) -> bytes:
    data = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(data, 0, group=group)
    return data.numpy().tobytes()
