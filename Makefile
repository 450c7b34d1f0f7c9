# The two commands of a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO   := .demo
PYTEST_ARGS ?= --durations=20  # the slowest tests listed at the end: where the suite's time goes
# The suite's workers (pytest-xdist -n): most tests wait on daemons in other processes, so
# one more worker than a 2-core machine's cores keeps both busy; TEST_JOBS=0 runs serially.
TEST_JOBS ?= 3
# Bytecode is cached (__pycache__/) even where the environment asks Python not to write it
# (PYTHONDONTWRITEBYTECODE, set on some CI images): every daemon, worker and mlxctl that the
# demo or a test starts imports mlxceld, and compiling its modules from source again each
# time was a quarter of a daemon's start (pytest's rewritten test modules are cached too).
export PYTHONDONTWRITEBYTECODE :=
MODEL ?=
MODEL_NAME ?=
PORT  ?= 8080
RUN_MODEL = $(if $(MODEL),$(MODEL),$(DEMO)/model)
RUN_NAME  = $(if $(MODEL),$(notdir $(patsubst %/,%,$(MODEL))),tiny-qwen3)

.PHONY: run run-single run-pipeline test test-fast install lint typecheck dist formula clean

$(BIN)/python:
	@echo "creating a virtual environment in $(VENV) ($(PYTHON) -m venv)..."
	@$(PYTHON) -m venv $(VENV)

# Says what it does: pip is --quiet, and the first install (mlx, mlx-lm and the rest) takes
# minutes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@echo "installing mlxceld and its dependencies into $(VENV) (the first run takes a few minutes)..."
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@
	@echo "installed mlxceld $$($(BIN)/python -c 'import mlxceld; print(mlxceld.__version__)') into $(VENV)"

install: $(VENV)/.installed

# The product's demo: a zero-config 2-stage cluster on loopback. A coordinator
# (mlxceld --pp-auto 2, 127.0.0.1) and two peers (--pp-peer, 127.0.0.2 and .3), each a
# real daemon with its own state dir under $(DEMO)/cluster, a generated secret (0600) and
# a generated tiny model unless MODEL= names one; see contrib/demo/cluster.py.
run: install
	@echo "bringing up a 2-stage cluster on loopback (contrib/demo/cluster.py; logs in $(DEMO)/cluster)..."
	@exec $(BIN)/python contrib/demo/cluster.py $(if $(MODEL),--model $(MODEL)) \
		$(if $(MODEL_NAME),--model-name $(MODEL_NAME)) --port $(PORT) --dir $(DEMO)/cluster

# One daemon serving the whole model (no cluster): the embedded default.
run-single: install
	@mkdir -p $(DEMO)
	@if [ -z "$(MODEL)" ] && [ ! -f $(DEMO)/model/config.json ]; then \
		echo "No MODEL given: generating a tiny random-weight model in $(DEMO)/model"; \
		$(BIN)/mlxctl model fixture $(DEMO)/model --preset tiny --family qwen3 >/dev/null; \
	fi
	@echo ""
	@echo "Starting mlxceld in the foreground, serving $(RUN_MODEL) on 127.0.0.1:$(PORT)."
	@echo "When the router is running (a few seconds), in another terminal:"
	@echo ""
	@echo "  export MLXCELD_SOCKET=$(CURDIR)/$(DEMO)/mlxceld.sock"
	@echo "  $(BIN)/mlxctl status          # the daemon, its workers, what is unhealthy"
	@echo "  $(BIN)/mlxctl logs router -f  # the router worker's log"
	@echo ""
	@echo "  curl -s http://127.0.0.1:$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(RUN_NAME)\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 32}'"
	@echo ""
	@echo "  $(BIN)/python -c 'import openai; c = openai.OpenAI(base_url=\"http://127.0.0.1:$(PORT)/v1\", api_key=\"none\"); \\"
	@echo "    print(c.chat.completions.create(model=\"$(RUN_NAME)\", messages=[{\"role\": \"user\", \"content\": \"Hello!\"}], max_tokens=32).choices[0].message.content)'"
	@echo ""
	@echo "Stop it with Ctrl-C here, or: $(BIN)/mlxctl stop"
	exec $(BIN)/mlxceld --config contrib/demo/mlxceld.toml --state-dir $(DEMO)/state \
		--socket $(CURDIR)/$(DEMO)/mlxceld.sock --model $(RUN_MODEL) --model-name $(RUN_NAME) --port $(PORT)

# A 2-stage pipeline from a hand-written cluster TOML (no --pp-auto): three daemons on
# 127.0.0.1 (coordinator), 127.0.0.2 and 127.0.0.3 (stages); see contrib/demo/pipeline.py.
run-pipeline: install
	@mkdir -p $(DEMO)
	@if [ -z "$(MODEL)" ] && [ ! -f $(DEMO)/model/config.json ]; then \
		echo "No MODEL given: generating a tiny random-weight model in $(DEMO)/model"; \
		$(BIN)/mlxctl model fixture $(DEMO)/model --preset tiny --family qwen3 >/dev/null; \
	fi
	exec $(BIN)/python contrib/demo/pipeline.py --model $(RUN_MODEL) --model-name $(RUN_NAME) \
		--port $(PORT) --dir $(DEMO)/pipeline

# Every test, TEST_JOBS at a time (each file whole on one worker: pyproject.toml's addopts).
test: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) $(PYTEST_ARGS)

# The quick loop while working: the same, less the tests marked slow (over ~8 s each).
test-fast: install
	$(BIN)/python -m pytest -n $(TEST_JOBS) -m "not slow" $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check mlxceld mlxctl tests bench contrib packaging

typecheck: install
	$(BIN)/mypy
	$(BIN)/mypy packaging/homebrew/formula.py

# A release: `make formula` builds dist/mlxceld-VERSION.tar.gz (and the wheel built from it,
# as pip does from the unpacked sdist) and writes packaging/homebrew/mlxceld.rb for it. Attach
# that sdist to the GitHub release vVERSION: the formula's url points there.
VERSION = $(shell $(BIN)/python -c 'import mlxceld; print(mlxceld.__version__)')
SDIST   = dist/mlxceld-$(VERSION).tar.gz

dist: install
	rm -rf dist
	$(BIN)/python -m build --quiet --no-isolation --outdir dist .

formula: dist
	$(BIN)/python packaging/homebrew/formula.py $(SDIST) --output packaging/homebrew/mlxceld.rb

clean:
	rm -rf $(VENV) $(DEMO) build dist *.egg-info
