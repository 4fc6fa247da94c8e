# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed first (a CPU build; an unpinned torch pulls a multi-GB CUDA build).

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin

export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-hosts lint install clean

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
	$(BIN)/python -m pytest --ignore=tests/test_hosts.py

# several hosts: network namespaces joined by a veth pair (root and iproute2's `ip`; skipped with the reason otherwise)
test-hosts: $(BIN)/.installed
	@command -v ip >/dev/null || [ "$$(id -u)" != 0 ] || (apt-get update -qq && apt-get install -y -qq iproute2)
	$(BIN)/python -m pytest tests/test_hosts.py

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
