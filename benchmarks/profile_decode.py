"""Where a decode step's time goes: the engine built in-process on the default model, a batch
of B sequences all decoding, each step split into phases.

    .venv/bin/python benchmarks/profile_decode.py [--batch 1 16 64] [--steps 40]
        [--dtype auto] [--threads N] [--torch-profile] [--device cuda] [--per-op]
        [--int16-ab [--rounds 5]]

Phases (perf_counter around the engine's own methods; the CPU runs ops synchronously, so
wall time is the time spent):
  schedule      Scheduler.schedule: which chunks run, pages, prefix-cache registration
  input prep    ModelRunner._flatten + backend.prepare: token/position tensors, slot
                mapping, context slots and masks
  forward       LlamaModel.forward, split into
                  matmuls       ops.linear (qkv, o, gate_up, down)
                  attention     backend.attend: KV write, then the decode kernel or the
                                context gather + SDPA
                  norms         rms_norm and add_rms_norm (the residual add fused with
                                the next norm where the ops have it), q/k norms
                  rotary        rope
                  silu*up       silu_and_mul
                  fused layers  CpuKernelOps.decode_layer: a whole layer in one kernel call
                                (pure decode steps over GGUF blocks; --per-op splits it
                                into the parts above)
                  rest          embedding, the last residual add, views, Python between them
  logits        final norm + lm_head on the sampled rows
  sampling      ModelRunner._sample: logits processors, sampling-row tensors, argmax/draw
  output        EngineCore.step's remainder: per-sequence bookkeeping, stop checks, outputs
With --torch-profile, torch.profiler's top ops (self CPU time) for the same steps follow.
With --int16-ab, no phases: the int16 path (CpuKernelOps.int16_x_max_rows) off and at its
setting in alternating rounds of --steps steps on one engine, each round's ratio of the two
step times taken seconds apart, so a shared machine's load hits both alike; it prints the
median ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections import defaultdict

import torch

from engine.process.build import build_engine
from shared.config import EngineConfig
from shared.model_source import default_model_path, served_model_name
from shared.protocol import EngineRequest, SamplingParams, pack_ids

PROMPT_LEN = 48  # a chat-sized prompt; the context grows by one per step from there


class Timer:
    """Accumulates wall time per phase. Inside an opaque phase (logits, sampling) the inner
    wrappers stay quiet, so the final norm and lm_head count as logits, not as forward."""

    OPAQUE = frozenset({"logits", "sampling"})

    def __init__(self, clock=time.perf_counter) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.active = False
        self.clock = clock
        self._opaque_depth = 0
        self._inside: set[str] = set()

    def wrap(self, name: str, fn):
        opaque = name in self.OPAQUE

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.active or self._opaque_depth or name in self._inside:
                return fn(*args, **kwargs)  # nested in a phase of the same name: counted once
            self._inside.add(name)
            self._opaque_depth += opaque
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += self.clock() - start
                self._opaque_depth -= opaque
                self._inside.discard(name)

        return timed


def instrument(core, timer: Timer) -> None:
    runner, model, backend = core.runner, core.runner.model, core.runner.backend
    core.step = timer.wrap("step", core.step)
    core.scheduler.schedule = timer.wrap("schedule", core.scheduler.schedule)
    runner.execute = timer.wrap("execute", runner.execute)
    runner._flatten = timer.wrap("input prep", runner._flatten)
    backend.prepare = timer.wrap("input prep", backend.prepare)
    model.forward = timer.wrap("forward", model.forward)
    model.logits = timer.wrap("logits", model.logits)
    runner._sample = timer.wrap("sampling", runner._sample)
    backend.attend = timer.wrap("attention", backend.attend)
    ops = model.ops
    ops.add_rms_norm = timer.wrap("norms", ops.add_rms_norm)  # residual add + norm
    ops.rms_norm = timer.wrap("norms", ops.rms_norm)
    ops.rope = timer.wrap("rotary", ops.rope)
    ops.silu_and_mul = timer.wrap("silu*up", ops.silu_and_mul)
    ops.linear = timer.wrap("matmuls", ops.linear)
    if hasattr(ops, "decode_layer"):
        ops.decode_layer = timer.wrap("fused layers", ops.decode_layer)


def add_requests(core, batch: int, max_tokens: int, vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist()
        core.add(EngineRequest(
            request_id=f"p{i}",
            prompt_token_ids=pack_ids(prompt),
            params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            reply_to="inproc://profile",
            arrival_time=time.time(),
        ))


def settle(core, batch: int) -> None:
    """Step until every sequence has finished its prefill, so what follows is pure decode."""
    while not (len(core.scheduler.running) == batch and all(
        s.num_computed == len(s.token_ids) - 1 for s in core.scheduler.running
    )):
        core.step()


FORWARD_PARTS = ("fused layers", "matmuls", "attention", "norms", "rotary", "silu*up")


def report(batch: int, steps: int, t: dict[str, float]) -> str:
    ms = {name: 1000 * value / steps for name, value in t.items()}
    get = lambda name: ms.get(name, 0.0)  # noqa: E731
    step = get("step")
    rows = [("schedule", get("schedule")), ("input prep", get("input prep")),
            ("forward", get("forward"))]
    rows += [(f"  {name}", get(name)) for name in FORWARD_PARTS]
    rows.append(("  rest", get("forward") - sum(get(n) for n in FORWARD_PARTS)))
    rows += [("logits", get("logits")), ("sampling", get("sampling"))]
    # execute = input prep + forward + logits + sampling + the runner's own glue.
    rows.append(("runner glue", get("execute") - get("input prep") - get("forward")
                 - get("logits") - get("sampling")))
    rows.append(("output", step - get("execute") - get("schedule")))
    lines = [f"batch {batch}: {step:.2f} ms/step, {1000 * batch / step:.0f} tok/s"]
    lines += [f"  {name:<14} {value:8.3f} ms  {100 * value / step:5.1f}%" for name, value in rows]
    return "\n".join(lines)


def profile_ops(core, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            core.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def int16_ab(core, args, batch: int) -> None:
    """--int16-ab: ms per step with the int16 path off and on, alternating rounds."""
    ops = core.runner.model.ops
    on = getattr(ops, "int16_x_max_rows", 0)
    if not on:
        print(f"batch {batch}: the int16 path is off here (build, dtype or setting)")
        return
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    times: dict[int, list[float]] = {0: [], on: []}
    for _ in range(args.rounds):
        for rows in (0, on):
            ops.int16_x_max_rows = rows
            start = clock()
            for _ in range(args.steps):
                core.step()
            times[rows].append(1000 * (clock() - start) / args.steps)
    ratio = statistics.median(a / b for a, b in zip(times[on], times[0], strict=True))
    print(f"batch {batch}: ms/step int16 off {min(times[0]):.2f}, on (up to {on} rows) "
          f"{min(times[on]):.2f} (best of {args.rounds}); on/off median {ratio:.3f}",
          flush=True)


def run_batch(args, batch: int) -> None:
    config = EngineConfig(
        model=args.model,
        served_model_name=served_model_name(args.model),
        request_address="inproc://unused",
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        max_num_seqs=max(batch, 1),
        max_model_len=PROMPT_LEN + (3 + 2 * args.rounds) * args.steps + 64,
    )
    core = build_engine(config)
    core.runner.model.fuse_decode_layers = not args.per_op
    timer = Timer(time.thread_time if args.clock == "thread" else time.perf_counter)
    instrument(core, timer)
    add_requests(core, batch, (3 + 2 * args.rounds) * args.steps + 32, core.vocab_size)
    settle(core, batch)
    for _ in range(args.warmup):
        core.step()
    if args.int16_ab:
        return int16_ab(core, args, batch)
    timer.active = True
    for _ in range(args.steps):
        core.step()
    timer.active = False
    print(report(batch, args.steps, timer.total), flush=True)
    if args.torch_profile:
        print(profile_ops(core, min(args.steps, 10), args.top), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per batch")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda (each step ends in the sampled tokens' copy to the "
                             "host, so its wall time is the GPU's; the phases are not)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: CPU time of this thread, which with --threads 1 is all the work and "
        "ignores time lost to other processes on a shared machine",
    )
    parser.add_argument("--per-op", action="store_true",
                        help="run every op of a layer from Python (no fused decode layers), "
                        "to see the parts")
    parser.add_argument("--torch-profile", action="store_true", help="also torch.profiler ops")
    parser.add_argument("--int16-ab", action="store_true",
                        help="time the int16 path off against on, alternating (no phases)")
    parser.add_argument("--rounds", type=int, default=5, help="--int16-ab's rounds")
    parser.add_argument("--top", type=int, default=25, help="ops shown by --torch-profile")
    args = parser.parse_args()
    args.model = args.model or default_model_path()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"{args.clock} clock")
    for batch in args.batch:
        with contextlib.suppress(KeyboardInterrupt):
            run_batch(args, batch)


if __name__ == "__main__":
    main()
