"""Who this process is among an engine's tensor-parallel ranks, and where they meet.

Two ways to say it, as torch.distributed itself knows them:
- the flags: `--tensor-parallel-size N` over `--nnodes M` machines, this one
  `--node-rank K`; ranks K*N/M .. (K+1)*N/M - 1 run here, the first of them in this process
  (it starts the others); they meet at `--master-addr:--master-port` (rank 0's host);
- torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): this
  process is exactly rank RANK and starts nothing; WORLD_SIZE must equal N.
Rank 0 is the engine the frontends see; every other rank only follows its steps.
"""

from __future__ import annotations

import os

import msgspec

from shared.startup_checks import StartupError
from shared.transport import free_tcp_port

DEFAULT_MASTER_PORT = 29500  # torchrun's


class Rendezvous(msgspec.Struct, frozen=True):
    world_size: int
    rank: int  # this process's
    local_rank: int  # its index among its machine's ranks (its GPU on CUDA)
    local_world: int  # ranks on this machine (how its CPUs are shared)
    master_addr: str
    master_port: int
    spawn: tuple[int, ...] = ()  # ranks this process starts beside itself (its machine's)


def plan_rendezvous(tensor_parallel_size: int, nnodes: int = 1, node_rank: int = 0,
                    master_addr: str | None = None, master_port: int | None = None,
                    environ=os.environ) -> Rendezvous | None:
    """This process's place, or None for a one-rank engine. A combination that cannot
    work stops the engine with one line naming it."""
    n = tensor_parallel_size
    world_env = environ.get("WORLD_SIZE")
    if world_env is not None and environ.get("RANK") is not None and int(world_env) > 1:
        return _from_torchrun(n, environ)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise StartupError(f"--node-rank {node_rank} is not within 0..{nnodes - 1} "
                           f"(--nnodes {nnodes})")
    if n == 1:
        if nnodes > 1:
            raise StartupError(f"--nnodes {nnodes} spreads the ranks of --tensor-parallel-size"
                               " over machines; with one rank there is nothing to spread")
        return None
    if n % nnodes:
        raise StartupError(f"--tensor-parallel-size {n} does not divide into --nnodes "
                           f"{nnodes} machines")
    if nnodes > 1 and not master_addr:
        raise StartupError(f"--nnodes {nnodes} needs --master-addr: the host of node 0, "
                           "where the ranks meet")
    per = n // nnodes
    first = node_rank * per
    if master_port is None:
        master_port = free_tcp_port() if nnodes == 1 else DEFAULT_MASTER_PORT
    return Rendezvous(world_size=n, rank=first, local_rank=0, local_world=per,
                      master_addr=master_addr or "127.0.0.1", master_port=master_port,
                      spawn=tuple(range(first + 1, first + per)))


def _from_torchrun(n: int, environ) -> Rendezvous:
    world, rank = int(environ["WORLD_SIZE"]), int(environ["RANK"])
    if world != n:
        raise StartupError(f"WORLD_SIZE={world} (the torchrun environment) does not match "
                           f"--tensor-parallel-size {n}")
    if not 0 <= rank < world:
        raise StartupError(f"RANK={rank} is not within 0..{world - 1}")
    if not environ.get("MASTER_ADDR") or not environ.get("MASTER_PORT"):
        raise StartupError("the torchrun environment sets RANK and WORLD_SIZE but not "
                           "MASTER_ADDR and MASTER_PORT")
    return Rendezvous(world_size=world, rank=rank,
                      local_rank=int(environ.get("LOCAL_RANK", rank)),
                      local_world=int(environ.get("LOCAL_WORLD_SIZE", world)),
                      master_addr=environ["MASTER_ADDR"], master_port=int(environ["MASTER_PORT"]))


def for_rank(rdv: Rendezvous, rank: int) -> Rendezvous:
    """The place of a rank this process starts on its machine."""
    return msgspec.structs.replace(rdv, rank=rank, local_rank=rdv.local_rank + rank - rdv.rank,
                                   spawn=())
