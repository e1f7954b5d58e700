"""The engine process: continuous batching over a paged KV cache (docs/architecture.md)."""

import os

# OpenMP threads that wait for work sleep rather than spin (read once, when torch loads
# libgomp, so it is set here, before any engine module imports torch). Spinning, or gomp's
# default spin-then-sleep, holds a core the frontend, the postproc workers or another rank
# need; on a machine with as many threads as cores a decode step then stalls behind the
# scheduler, by up to a second on two cores (docs/benchmarks.md). A user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
