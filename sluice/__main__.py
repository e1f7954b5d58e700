"""`python -m sluice ...`: what `serve` starts its processes with, and the same as `sluice`."""

import os
import sys

from sluice.cli import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
