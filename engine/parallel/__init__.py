"""Tensor parallelism's control: one model over several ranks (processes), wired with
torch.distributed.

- `rendezvous`: who this process is (rank, world, master address) from the flags or the
  torchrun environment.
- `leader`: rank 0, inside the engine: starts the local ranks, sends each step's plan.
- `commands`: what rank 0 sends the others.

The slice of each tensor a rank holds and its collectives are layers
(engine.layers.sharding, engine.layers.tp_group); every rank but 0 runs
engine.process.tp_worker.
"""
