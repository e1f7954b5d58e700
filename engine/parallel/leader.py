"""Rank 0's side: it starts this machine's other ranks, joins the group, and stands in for
the model and the attention backend inside the engine, so the scheduler, KV allocator,
grammar and sampling (ModelRunner, EngineCore) run unchanged on rank 0 only.

- `LeaderModel.forward` sends each step's plan (one command: the chunks `LeaderBackend.prepare`
  saw, each with its LoRA adapter id, and a VLM's image embeddings, which rank 0's vision
  encoder made); every rank then runs the same forward pass over its shard.
- `LeaderModel.lora_change` sends an adapter loaded or removed on rank 0 (one command);
  every rank applies it to its slices and answers.
- `LeaderModel.logits` sends the hidden rows (one command) and returns the gathered
  full-vocabulary logits, which only rank 0 samples from.

A watchdog thread watches the ranks this process started: one that exits takes the engine
down at once (one log line, exit 1), so nothing waits on a rank that is gone; the frontends
then treat the engine as dead, as for any engine fault. A rank that hangs (stopped, or
stuck) makes rank 0's next command or collective wait at most COLLECTIVE_TIMEOUT; the
engine then stops naming it (a rank started here that is stopped) or saying a collective
timed out (a rank on another machine). Ranks on other machines that die close their
sockets: the step fails at once. Whatever ends the engine, it kills the ranks it started
first, so none is left behind (a stopped one would not act on the SIGTERM its parent's
death sends it).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from engine.layers.sharding import Shard
from engine.layers.tp_group import TPGroup
from engine.parallel import commands
from engine.parallel.rendezvous import Rendezvous, for_rank
from shared.config import EngineConfig

log = logging.getLogger("sluice.engine")

# How long a step's collective waits for a peer (a hung rank) before the step fails.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(
    os.environ.get("SLUICE_TP_TIMEOUT_S", "120")))
# How long a failed collective waits for a rank started here to be seen exiting (its
# sockets can close a moment before the process is reaped).
REAP_WAIT_S = 2.0
# How long the ranks wait for each other at start: each loads its shard first, which can
# take minutes for a large model (the default group's timeout).
STARTUP_TIMEOUT = max(COLLECTIVE_TIMEOUT, datetime.timedelta(minutes=30))


def connect(rdv: Rendezvous, device: torch.device, shard: Shard):
    """Join the ranks (blocks until all have come); returns (TPGroup, command group)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{rdv.master_addr}:{rdv.master_port}",
        rank=rdv.rank, world_size=rdv.world_size, timeout=STARTUP_TIMEOUT)
    cmd_group = dist.new_group(backend="gloo", timeout=commands.IDLE_TIMEOUT)
    compute = dist.new_group(backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(shard, compute), cmd_group


class WorkerSpec(msgspec.Struct):
    """What a started rank needs: the engine's config and its own place."""

    config: EngineConfig
    rendezvous: Rendezvous
    config_log_level: str = "info"


def spawn_ranks(config, rdv: Rendezvous) -> list[tuple[int, subprocess.Popen]]:
    """Start this machine's other ranks (engine.process.tp_worker), each dying with us."""
    procs = []
    for rank in rdv.spawn:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        spec = WorkerSpec(config, for_rank(rdv, rank), level)
        spec = msgspec.json.encode(spec).decode()
        proc = subprocess.Popen([sys.executable, "-m", "engine.process.tp_worker", spec],
                                preexec_fn=_dies_with_parent)
        procs.append((rank, proc))
    return procs


def _dies_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies, however it dies (Linux's
    parent-death signal), so no rank outlives its engine."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Watchdog:
    """Ends this process when a rank it started exits (unless we are closing)."""

    def __init__(self, procs: list[tuple[int, subprocess.Popen]], on_lost=None) -> None:
        self.procs = procs
        self.closing = threading.Event()
        self.on_lost = on_lost or (lambda rank, code: _exit_engine(rank, code, procs))
        self.thread = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.closing.wait(0.2):
            for rank, proc in self.procs:
                code = proc.poll()
                if code is not None and not self.closing.is_set():
                    self.on_lost(rank, code)
                    return


def _exited_rank(procs: list[tuple[int, subprocess.Popen]], wait_s: float
                 ) -> tuple[int, int] | None:
    """(rank, exit code) of a rank this process started that has exited, waiting up to
    wait_s for one to be reaped; None if all still run (or none was started here)."""
    deadline = time.monotonic() + wait_s
    while procs:
        for rank, proc in procs:
            code = proc.poll()
            if code is not None:
                return rank, code
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return None


def _stopped_ranks(procs: list[tuple[int, subprocess.Popen]]) -> list[int]:
    """Ranks started here that are stopped (SIGSTOP, a stopping signal, a tracer's stop):
    alive, and never answering."""
    stopped = []
    for rank, proc in procs:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            stopped.append(rank)
    return stopped


def _timed_out(exc: BaseException) -> bool:
    """A collective that gave up waiting for a peer (gloo's and NCCL's words for it)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def collective(procs: list[tuple[int, subprocess.Popen]], fn, *args, **kwargs):
    """fn (a step's collectives) run. When one fails because a rank died (one started here:
    the watchdog's line, whichever noticed first) or hung (waited COLLECTIVE_TIMEOUT), the
    engine stops naming it; any other error goes on as it is."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # gloo / NCCL: a peer closed its connection, or timed out
        lost = _exited_rank(procs, wait_s=REAP_WAIT_S)
        if lost is not None:
            _exit_engine(*lost, procs)
        stopped = _stopped_ranks(procs)
        if stopped or _timed_out(exc):
            _hung_engine(stopped, exc, procs)
        raise


def _exit_engine(rank: int, code: int, procs=()) -> None:
    _stop_engine(f"tensor-parallel rank {rank} exited (code {code})", procs)


def _hung_engine(stopped: list[int], exc: BaseException, procs=()) -> None:
    wait = COLLECTIVE_TIMEOUT.total_seconds()
    if stopped:
        ranks = ", ".join(str(r) for r in stopped)
        why = f"tensor-parallel rank {ranks} is stopped (hung; a collective gave up on it)"
    else:
        why = (f"a tensor-parallel collective timed out after {wait:g}s: a rank hung "
               f"({type(exc).__name__}: {exc})")
    _stop_engine(why, procs)


def _stop_engine(why: str, procs) -> None:
    """One line, the ranks started here killed (a stopped one would not act on the SIGTERM
    our death sends it), exit 1."""
    log.error("%s: the engine stops", why)
    for _, proc in procs:
        if proc.poll() is None:
            proc.kill()
    logging.shutdown()
    os._exit(1)


class LeaderBackend:
    """Rank 0's attention backend: keeps the step's chunks for its plan (sent with the
    forward pass), then is the backend it wraps."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.chunks = None

    def prepare(self, chunks):
        self.chunks = chunks
        return self.inner.prepare(chunks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class LeaderModel:
    """Rank 0's model: its shard's forward; logits sent to every rank and gathered."""

    def __init__(self, inner, cmd_group, procs, watchdog: Watchdog | None) -> None:
        self.inner = inner
        self._cmd = cmd_group
        self.procs = procs
        self.watchdog = watchdog
        self.closed = False

    def forward(self, input_ids, positions, backend, meta, embeds=None):
        return collective(self.procs, self._forward, input_ids, positions, backend, meta,
                          embeds)

    def _forward(self, input_ids, positions, backend, meta, embeds):
        payload = commands.plan_of(backend.chunks, 0 if embeds is None else len(embeds[0]))
        commands.send_command(self._cmd, commands.STEP, len(payload), payload,
                              COLLECTIVE_TIMEOUT)
        if embeds is not None:
            rows = embeds[0].to(torch.long).contiguous()
            vectors = embeds[1].to(self.inner.dtype).contiguous()
            self.inner.tp.broadcast(rows)
            self.inner.tp.broadcast(vectors)
            embeds = (rows, vectors)
        return self.inner.forward(input_ids, positions, backend, meta, embeds)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        return collective(self.procs, self._logits, hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        commands.send_command(self._cmd, commands.LOGITS, hidden.shape[0],
                              timeout=COLLECTIVE_TIMEOUT)
        self.inner.tp.broadcast(hidden)
        return self.inner.logits(hidden)

    def lora_change(self, change) -> list[tuple[int, str]]:
        """An adapter loaded or removed on rank 0 (engine.step.lora_adapters.LoraChange), applied by
        every rank: (rank, its error) for each rank that could not."""
        return collective(self.procs, self._lora_change, change)

    def _lora_change(self, change) -> list[tuple[int, str]]:
        payload = msgspec.msgpack.encode(change)
        commands.send_command(self._cmd, commands.LORA, len(payload), payload,
                              COLLECTIVE_TIMEOUT)
        words = commands.verdicts(self._cmd, "", COLLECTIVE_TIMEOUT)
        return [(rank, word) for rank, word in enumerate(words) if word]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the ranks and leave the group (an engine's end, or a test's)."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.closing.set()
        try:
            commands.send_command(self._cmd, commands.STOP, 0, timeout=COLLECTIVE_TIMEOUT)
        except Exception as exc:  # a rank already gone: nothing to tell it
            log.warning("could not tell the ranks to stop: %s", exc)
        for _, proc in self.procs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()

    def __getattr__(self, name):
        return getattr(self.inner, name)
