"""A rank's collectives: what the sharded model blocks call, and nothing else.

`SINGLE` (one rank) makes every collective a no-op, so the model code is the same with and
without tensor parallelism. A step's collectives run on the compute group (gloo on CPU, NCCL
on CUDA), whose timeout (engine.parallel.leader.COLLECTIVE_TIMEOUT) bounds how long a rank
waits for a hung peer; the start-up ones (`min_int`, after each rank's load, which may take
long) on the default group, with the longer start-up timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.layers.sharding import Shard


class TPGroup:
    def __init__(self, shard: Shard | None = None, group=None) -> None:
        self.shard = shard
        self.group = group  # the compute group (None: the default group)
        self.rank = shard.rank if shard else 0
        self.size = shard.size if shard else 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial output (after a row-parallel block)."""
        if self.size > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's `x` into every rank's (the hidden rows of an LM-head call)."""
        if self.size > 1:
            dist.broadcast(x, 0, group=self.group)

    def gather_last(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's equal-width slice of the last dimension, side by side, cut to
        `length` (the vocabulary without the padding of its last part)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)[..., :length]

    def sum_at_start(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` summed (on `x`'s device), on the default group: a start-up sum,
        which ranks reach as their loads end."""
        if self.size > 1:
            x = x.contiguous()
            dist.all_reduce(x)
        return x

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (KV pages: the same count everywhere), on
        the default group: ranks reach it as their loads end."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = TPGroup()
