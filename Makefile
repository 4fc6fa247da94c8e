# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed first (a CPU build; an unpinned torch pulls a multi-GB CUDA build).

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin

export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-families test-trl test-hosts test-accel test-xla xla-env lint install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/optimum-parallel demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest --ignore=tests/test_hosts.py --ignore=tests/test_hosts_launchers.py --durations=30

# the family matrix: tiny models of today's families (transformers' own config classes) at every layout their structure
# allows, against one process, or refused naming the module (tests/family_matrix.py); each cell is written to
# build/family-matrix.jsonl, which `python scripts/supported_models.py --results build/family-matrix.jsonl` prints as
# the README's support table; beside it the hybrid, MoE and vision-language families' own checks.
test-families: $(BIN)/.installed
	$(BIN)/python -m pytest tests/families --durations=10

# TRL's DPO and GRPO trainers on every layout against TRL on one process, and the TRL examples under torchrun
test-trl: $(BIN)/.installed
	$(BIN)/python -m pytest tests/trl --durations=10

# several hosts: network namespaces joined by a veth pair (root and iproute2's `ip`; skipped with the reason otherwise)
test-hosts: $(BIN)/.installed
	@command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	$(BIN)/python -m pytest tests/test_hosts.py tests/test_hosts_launchers.py

# the accelerator lane: every parallelism on a simulated accelerator, `neuron` (PrivateUse1 over host memory, its own
# process-group backend; tests/accel/simulated_neuron.py), about a minute on 2 cores. Its C++ hooks (generators,
# pinned memory, storage resize) are built once per machine into ~/.cache/optimum-parallel/neuron-ext by torch's
# cpp_extension, which needs g++ (apt, where root can) and ninja (pip, into the venv, put on PATH); where the build
# fails the device runs in pure Python and the tests needing the hooks say so (skipped).
# OP_TEST_DEVICE=cuda runs the same cases on a GPU: scripts/device_check.sh.
test-accel: $(BIN)/.installed
	@command -v g++ >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq g++) || true
	@command -v ninja >/dev/null || [ -x $(BIN)/ninja ] || $(BIN)/python -m pip install --quiet ninja || true
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest tests/accel --durations=10

# XLA devices (the Neuron path) on this machine's CPU: torch-xla runs with PJRT_DEVICE=CPU. torch-xla 2.9 needs
# torch 2.9 (PyPI's, a CUDA build, ~7 GB installed), so it gets its own environment, cached outside the clone and
# reused by every clone; this clone is installed into it editable (re-pointed when another clone installed last).
XLA_VENV  ?= $(HOME)/.cache/optimum-parallel/xla-venv
XLA_TORCH ?= torch==2.9.0 torch-xla==2.9.0
XLA_BIN    = $(XLA_VENV)/bin

$(XLA_BIN)/.installed:
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install --quiet --upgrade pip
	$(XLA_BIN)/python -m pip install --quiet $(XLA_TORCH)
	$(XLA_BIN)/python -m pip install --quiet "transformers>=5" accelerate safetensors tqdm "click>=8" pytest pytest-timeout
	touch $@

xla-env: $(XLA_BIN)/.installed
	@(cd / && $(XLA_BIN)/python -c "import optimum_parallel as m, sys; sys.exit(not m.__file__.startswith('$(CURDIR)/'))") \
		2>/dev/null || $(XLA_BIN)/python -m pip install --quiet --no-deps -e .

test-xla: xla-env
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest tests/xla

# style, the import arrows of docs/architecture.md (import-linter, pyproject.toml [tool.importlinter]) and dead code
# (vulture, [tool.vulture])
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/vulture

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
