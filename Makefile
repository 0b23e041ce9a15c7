# The two commands a new user needs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
# CPU build of torch; on a GPU machine run `make setup TORCH_SPEC=torch` (or preinstall your build).
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# pytest-xdist workers for the suite (1: no workers); a test file runs on one worker, so its
# module fixtures are set up once.
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: setup demo test test-unit test-slow lint format protos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/hybrid-pd demo

lint: setup
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

# Rewrites the tree in place: imports sorted and fixable lint findings fixed, then formatted.
format: setup
	$(BIN)/python -m ruff check --fix .
	$(BIN)/python -m ruff format .

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) --durations=10

# The fast loop: tests/unit without the few tests there that start real services; no lint.
test-unit: setup
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "unit and not integration"

test-slow: setup
	HYBRID_PD_SLOW=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

protos: setup
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
