"""A rank's collectives: what the sharded model blocks call, and nothing else.

`SINGLE` (one rank) makes every collective a no-op, so the model code is the same with and
without tensor parallelism. The collectives run on the default process group (gloo on CPU,
NCCL on CUDA), whose timeout bounds how long a rank waits for a dead or hung peer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from engine.parallel.sharding import Shard


class TPGroup:
    def __init__(self, shard: Shard | None = None) -> None:
        self.shard = shard
        self.rank = shard.rank if shard else 0
        self.size = shard.size if shard else 1

    @property
    def parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial output (after a row-parallel block)."""
        if self.size > 1:
            x = x.contiguous()
            dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """Every rank's equal-width slice of the last dimension, side by side, cut to
        `length` (the vocabulary without the padding of its last part)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)[..., :length]

    def min_int(self, value: int) -> int:
        """The smallest `value` over the ranks (KV pages: the same count everywhere)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


SINGLE = TPGroup()
