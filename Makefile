# The two commands of a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO   := .demo
PYTEST_ARGS ?=

.PHONY: run test install lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

run: install
	@mkdir -p $(DEMO)
	@echo "Starting mlxceld in the foreground with the demo config (contrib/demo/mlxceld.toml)."
	@echo "In another terminal:"
	@echo "  export MLXCELD_SOCKET=$(CURDIR)/$(DEMO)/mlxceld.sock"
	@echo "  $(BIN)/mlxctl status        # the daemon and its workers"
	@echo "  $(BIN)/mlxctl logs demo-1   # a worker's log (-f to follow)"
	@echo "  $(BIN)/mlxctl events -f     # what the supervisor does"
	@echo "Stop it with Ctrl-C here, or: $(BIN)/mlxctl stop"
	exec $(BIN)/mlxceld --config contrib/demo/mlxceld.toml \
		--state-dir $(DEMO)/state --socket $(CURDIR)/$(DEMO)/mlxceld.sock

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check mlxceld mlxctl tests bench

typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(DEMO) build *.egg-info
