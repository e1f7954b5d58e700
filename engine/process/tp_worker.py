"""A tensor-parallel rank other than 0: loads its shard of the model and its KV cache (its
own heads, rank 0's page count), then follows rank 0's commands until STOP or until rank 0
is gone (its collectives fail: the rank exits, so nothing outlives its engine).

Run as `python -m engine.process.tp_worker SPEC` by rank 0 (or a node's first rank), SPEC
being a `WorkerSpec` in JSON; a torchrun-started rank gets here through `sluice engine`.
"""

from __future__ import annotations

import logging
import os
import sys

import msgspec
import torch
import torch.distributed as dist

from engine.parallel import commands
from engine.parallel.commands import PlanSeq
from engine.parallel.leader import WorkerSpec
from engine.parallel.rendezvous import Rendezvous
from shared.config import EngineConfig
from shared.log_format import FORMAT_ENV, setup_logging

log = logging.getLogger("sluice.engine")


def run_worker(config: EngineConfig, rdv: Rendezvous) -> None:
    from engine.process.load import load_rank
    from engine.request.batch import ScheduledChunk

    model, backend, cmd_group = load_rank(config, rdv)
    device, dtype = model.device, model.dtype
    lora = None
    if config.enable_lora:  # adapters come as LORA commands, under rank 0's ids
        from engine.step.lora_adapters import LoraManager

        lora = LoraManager(model, config.max_loras, config.max_lora_rank, 0)
    hidden_size = model.config.hidden_size
    log.info("tensor-parallel rank %d of %d ready", rdv.rank, rdv.world_size)
    with torch.inference_mode():
        while True:
            kind, n = commands.receive_command(cmd_group)
            if kind == commands.STEP:
                plan = commands.decode_plan(commands.receive_payload(cmd_group, n))
                chunks = [ScheduledChunk(PlanSeq(c.request_id, c.pages), c.start, c.num_tokens,
                                         c.draft) for c in plan.chunks]
                ids = [t for c in plan.chunks for t in (*c.fed, *c.draft)]
                positions = [p for c in plan.chunks for p in range(c.start, c.start + c.num_tokens)]
                embeds = None
                if plan.embeds:  # a VLM's image tokens: rank 0's encoder made them
                    rows = torch.empty(plan.embeds, dtype=torch.long, device=device)
                    vectors = torch.empty((plan.embeds, hidden_size), dtype=dtype,
                                          device=device)
                    model.tp.broadcast(rows)
                    model.tp.broadcast(vectors)
                    embeds = (rows, vectors)
                if lora is not None:
                    lora.ops.set_step([(c.lora_id, c.num_tokens) for c in plan.chunks],
                                      len(ids), device)
                meta = backend.prepare(chunks)
                model.forward(torch.tensor(ids, dtype=torch.long, device=device),
                              torch.tensor(positions, dtype=torch.long, device=device),
                              backend, meta, embeds)
            elif kind == commands.LOGITS:
                hidden = torch.empty((n, hidden_size), dtype=dtype, device=device)
                model.tp.broadcast(hidden)
                model.logits(hidden)
            elif kind == commands.LORA:
                change = commands.decode_change(commands.receive_payload(cmd_group, n))
                commands.verdicts(cmd_group, _apply_lora(lora, change))
            elif kind == commands.STOP:
                break
    dist.destroy_process_group()


def _apply_lora(lora, change) -> str:
    """This rank's slice of an adapter installed (or removed); "" or "STATUS why"."""
    from engine.step.lora_adapters import LoraError

    if lora is None:
        return "400 LoRA is not enabled on this rank"
    try:
        lora.apply(change)
    except LoraError as exc:
        log.warning("LoRA adapter %d: %s", change.adapter_id, exc)
        return f"{exc.status} {exc}"
    except Exception as exc:  # whatever else reading it raised: the adapter's fault
        log.warning("LoRA adapter %d: %s: %s", change.adapter_id, type(exc).__name__, exc)
        return f"400 {type(exc).__name__}: {exc}"
    return ""


def run_rank(config: EngineConfig, rdv: Rendezvous) -> int:
    """A rank's whole life (the ranks it starts on its machine too); its exit status."""
    from engine.parallel.leader import Watchdog, spawn_ranks

    procs = spawn_ranks(config, rdv)
    if procs:  # one of ours gone: this rank too, so rank 0 sees it at once
        Watchdog(procs, on_lost=lambda rank, code: _exit(f"rank {rank} exited ({code})"))
    try:
        run_worker(config, rdv)
    except SystemExit as exc:  # a start-up refusal: its one line
        log.error("%s", exc)
        return 1
    except Exception as exc:  # rank 0 gone, a collective timed out: this rank is done
        log.error("tensor-parallel rank %d stops: %s: %s", rdv.rank, type(exc).__name__, exc)
        for _, proc in procs:  # ours too, even a stopped one (SIGTERM waits for SIGCONT)
            proc.kill()
        return 1
    for _, proc in procs:
        proc.wait()
    return 0


def _exit(why: str) -> None:
    log.error("tensor-parallel rank stops: %s", why)
    logging.shutdown()
    os._exit(1)


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(argv[0], type=WorkerSpec)
    rank = spec.rendezvous.rank
    # The engine's --log-format (left in the environment by shared.log_format), its id too.
    setup_logging(spec.config_log_level, os.environ.get(FORMAT_ENV, "text"), "engine",
                  text_format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s",
                  engine_id=spec.config.engine_id, rank=rank)
    return run_rank(spec.config, spec.rendezvous)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
