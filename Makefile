# `make demo` and `make test` each do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.divjac-installed
CODE   := src tests examples

.PHONY: install demo test lint typecheck pytest bench bench-quick clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/divjac demo

lint: install
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/python -m pytest -n 2

test: lint typecheck pytest

bench: install
	$(BIN)/divjac bench

bench-quick: install
	$(BIN)/divjac bench --quick

clean:
	rm -rf $(VENV) divjac-demo bench-results .pytest_cache .mypy_cache .ruff_cache
