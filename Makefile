# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed first (a CPU build; an unpinned torch pulls a multi-GB CUDA build).

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin

export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-families test-trl test-hosts test-accel test-xla xla-env test-compat compat-env lint install clean

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
	$(BIN)/python -m pytest --ignore=tests/test_hosts.py --ignore=tests/test_hosts_launchers.py --ignore=tests/test_heartbeat.py \
		--durations=30

# the family matrix: tiny models of today's families (transformers' own config classes) at every layout their structure
# allows, against one process, or refused naming the module (tests/family_matrix.py); each cell is written to
# build/family-matrix.jsonl, which `python scripts/supported_models.py --results build/family-matrix.jsonl` prints as
# the README's support table; beside it the hybrid, MoE and vision-language families' own checks.
test-families: $(BIN)/.installed
	$(BIN)/python -m pytest tests/families --durations=10

# TRL's DPO and GRPO trainers on every layout against TRL on one process, and the TRL examples under torchrun
test-trl: $(BIN)/.installed
	$(BIN)/python -m pytest tests/trl --durations=10

# several hosts: network namespaces joined by a veth pair (root and iproute2's `ip`; skipped with the reason otherwise);
# the launchers across them; the heartbeat's torchrun jobs with a dead, frozen or slow rank (~4 min, mostly sleeping)
test-hosts: $(BIN)/.installed
	@command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	$(BIN)/python -m pytest tests/test_hosts.py tests/test_hosts_launchers.py tests/test_heartbeat.py

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

# the oldest versions this release is tested on (pyproject.toml's floors, TESTED in integrations/transformers/
# internals.py): torch 2.9, transformers 5.17 and accelerate 1.15 (the GPU image's), on a representative subset: tp+sp,
# pp, cp, dp levels 0-3, ep, the Trainer with save and resume, sharded checkpoints, lazy loading, PEFT, TRL's SFT. Its
# environment holds only what differs from the XLA one, whose torch 2.9 it reads through a .pth file (no second 7 GB
# copy); USE_TORCH_XLA=0 keeps accelerate and transformers off torch-xla's device, so the processes run gloo on CPU.
COMPAT_VENV  ?= $(HOME)/.cache/optimum-parallel/compat-venv
COMPAT_PINS  ?= transformers==5.17.0 accelerate==1.15.0 peft==0.21.2 trl==1.16.0
COMPAT_BIN    = $(COMPAT_VENV)/bin
COMPAT_TESTS ?= tests/test_internals.py tests/test_trainer.py tests/test_checkpoint.py tests/test_sequence_parallel.py \
	tests/test_pipeline.py tests/test_context_parallel.py tests/test_data_parallel.py tests/test_expert_parallel.py \
	tests/test_trl.py tests/test_peft.py tests/test_lazy.py
PURELIB       = -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"

$(COMPAT_BIN)/.installed: $(XLA_BIN)/.installed
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(XLA_BIN)/python $(PURELIB) > "$$($(COMPAT_BIN)/python $(PURELIB))/zz_xla_env.pth"
	$(COMPAT_BIN)/python -m pip install --quiet $(COMPAT_PINS) zlib-ng
	touch $@

compat-env: $(COMPAT_BIN)/.installed
	@(cd / && $(COMPAT_BIN)/python -c "import optimum_parallel as m, sys; sys.exit(not m.__file__.startswith('$(CURDIR)/'))") \
		2>/dev/null || $(COMPAT_BIN)/python -m pip install --quiet --no-deps -e .

# (GraniteMoE's config has a tensor-parallel plan from transformers 5.21 on: refused by name before it, as it should be)
test-compat: compat-env
	USE_TORCH_XLA=0 $(COMPAT_BIN)/python -m pytest $(COMPAT_TESTS) -k "not granitemoe"

# style, the import arrows of docs/architecture.md (import-linter, pyproject.toml [tool.importlinter]) and dead code
# (vulture, [tool.vulture])
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/vulture

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
