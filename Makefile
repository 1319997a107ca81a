# Two entry points: `make train` (set up + run the embedded default job) and `make test` (set up + run all tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: setup setup-dev train test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(DEV_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]"
	touch $@ $(STAMP)

setup: $(STAMP)
setup-dev: $(DEV_STAMP)

train: $(STAMP)
	$(BIN)/rlfleet demo $(ARGS)

test: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean:
	rm -rf runs .pytest_cache
