"""Tensor parallelism: one model over several ranks (processes), wired with torch.distributed.

- `sharding`: which slice of each checkpoint tensor a rank holds (by HF name), and the
  combinations refused at start.
- `group`: a rank's collectives (the model's all-reduces, the vocabulary gather).
- `rendezvous`: who this process is (rank, world, master address) from the flags or the
  torchrun environment.
- `leader`: rank 0, inside the engine: starts the local ranks, sends each step's plan.
- `worker`: every other rank: loads its shard and follows rank 0's steps.
"""
