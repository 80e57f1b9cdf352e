# Everything a user runs: `make train` and `make test` set themselves up on a fresh machine.
#   make train                      # the debug model on 2 CPU ranks (gloo), shipped data
#   make train CONFIG=configs/debug.toml NPROC=4 ARGS="--training.steps=50"
#   make test                       # the test suite (tests/, and benchmarks/ when it is there)
#   make bench                      # what each fix buys, measured: one table, bench.json, bench.png
#   make bench-gpu                  # one prepared ~10-minute run on one GPU (ARGS="--rehearse": on CPU, tiny)
#   TORCH_VERSION=2.11.0 make setup # another torch; a build of PyTorch's own index also needs the index, e.g.
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu128 TORCH_VERSION=2.13.0+cu128 make setup

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
CONFIG ?= configs/debug.toml
ARGS ?=

PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: setup train test bench bench-gpu lint fmt clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,eval]"
	rm -f $(VENV)/.installed-* && touch $@

# Ctrl-C stops the run: the ranks save, rank 0 prints one line, and that is all. fleet/launch.py is torchrun without its
# SignalException traceback; `exec` makes it make's child, not a shell that the signal kills (make then adds
# "*** [train] Interrupt"). make itself still ends on the signal, as make does: status 130.
train: setup
	OMP_NUM_THREADS=1 exec $(PY) -m fleet.launch --nproc_per_node=$(NPROC) train.py --config $(CONFIG) $(ARGS)

test: setup
	$(PY) -m pytest

bench: setup
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.run $(ARGS)

bench-gpu: setup
	$(PY) -m benchmarks.gpu_run $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf outputs .pytest_cache .ruff_cache
