# `make demo` and `make test` each do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.divjac-installed
CODE   := src tests examples

# The fast tests against the lowest supported versions, each set in its own venv:
# requirements-lowest-core.txt (NumPy, SciPy; on LOWEST_CORE_PYTHON, which .ci/run sets to
# Python 3.10 when there is one) and requirements-lowest-jax.txt (JAX needs Python 3.11).
LOWEST_CORE_PYTHON ?= $(PYTHON)
LOWEST_JAX_TESTS := src/divjac/jax tests/jax/test_errors.py tests/jax/test_sparsity.py \
	tests/jax/test_stochastic.py

# The newest releases (the other half of the version matrix), each in its own venv:
# requirements-newest-torch.txt (the newest torch, on PYTHON), requirements-newest-jax.txt (the
# newest JAX, on NEWEST_JAX_PYTHON: JAX >= 0.11 needs Python >= 3.12) and
# requirements-newest-core.txt (the core on NEWEST_CORE_PYTHON). .ci/run names the Pythons.
NEWEST_JAX_PYTHON ?= python3.12
NEWEST_CORE_PYTHON ?= python3.13
CROSS_TESTS := $(wildcard tests/test_*.py)
NEWEST_TORCH_TESTS := src/divjac/torch tests/torch $(CROSS_TESTS)
NEWEST_JAX_TESTS := src/divjac/jax src/divjac/_core tests/jax tests/core $(CROSS_TESTS)
NEWEST_CORE_TESTS := src/divjac/_core tests/core

# The torch floor (requirements-lowest-torch.txt, torch 2.11): the tests of its seam branches
# (which make test also takes on the pinned torch, by pretending), the refusal of torch.compile,
# the transforms and the context matrix. Opt-in: its install is too heavy for every CI run.
TORCH_FLOOR_TESTS := tests/torch/test_floor.py tests/torch/test_compile.py \
	tests/torch/test_transforms.py tests/torch/test_contexts.py tests/torch/test_conformance.py \
	tests/torch/test_sparsity.py tests/torch/test_taylor.py tests/torch/test_compat_seam.py

# Every venv of the version matrix (test-lowest's and test-newest's); .ci/run builds them at
# once with `make -j` beside the dev venv (pip mostly waits on the disk).
VERSION_VENVS := $(foreach v,lowest-core lowest-jax newest-torch newest-jax newest-core,.venv-$(v)/.divjac-installed)

.PHONY: install version-venvs demo test test-conformance test-slow test-matrix test-matrix-torch test-matrix-jax test-gpu lint typecheck pytest test-lowest test-newest test-torch-floor bench bench-quick clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

install: $(STAMP)

version-venvs: $(VERSION_VENVS)

.venv-lowest-core/.divjac-installed: PYTHON := $(LOWEST_CORE_PYTHON)
.venv-newest-jax/.divjac-installed: PYTHON := $(NEWEST_JAX_PYTHON)
.venv-newest-core/.divjac-installed: PYTHON := $(NEWEST_CORE_PYTHON)
.venv-%/.divjac-installed: requirements-%.txt pyproject.toml
	$(PYTHON) -m venv $(@D)
	$(@D)/bin/python -m pip install -q --upgrade pip
	$(@D)/bin/python -m pip install -q -r $<
	$(@D)/bin/python -m pip install -q --no-deps -e .
	touch $@

demo: install
	$(BIN)/divjac demo

lint: install
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)

typecheck: install
	$(BIN)/mypy

pytest: install
	$(BIN)/python -m pytest -n 2 --durations=15

test: lint typecheck pytest

# The op sweeps of the conformance matrix alone (every differentiable float64 OpInfo op of
# PyTorch, every JAX primitive case), with their coverage tables in docs/ (part of test-slow).
test-conformance: install
	$(BIN)/python -m pytest -n 2 -m slow tests/torch/test_conformance.py tests/jax/test_conformance.py

# The long part of the suite: the conformance matrix's op sweeps, the end-to-end calibration,
# the examples and the other cases marked slow. .ci/run runs it after make test.
test-slow: install
	$(BIN)/python -m pytest -n 2 --durations=15 -m slow

# The pairwise covers of the torch and JAX context matrices over every model (marker matrix; the
# default run of make test holds every transform, variant and axis value on the MLP). .ci/run
# runs torch's (701 cases, ~4.5 minutes on 2 cores); JAX's (620 cases, ~9 minutes) would take
# CI past its 45-minute budget.
test-matrix: test-matrix-torch test-matrix-jax

test-matrix-torch: install
	$(BIN)/python -m pytest -n 2 --durations=15 --dist loadgroup -m matrix tests/torch/test_contexts.py

test-matrix-jax: install
	$(BIN)/python -m pytest -n 2 --durations=15 --dist loadgroup -m matrix tests/jax/test_contexts.py

# The device tests (tests/accelerator, marker accelerator) on the GPUs and TPUs present, skipped
# where none is: divjac from source, on any Python that has the frameworks (no venv, no install:
# `make test-gpu PYTHON=python3` on a device image). DIVJAC_ACCELERATOR_TESTS_ON_CPU=1 runs their
# bodies on the CPU. One process (the device is not shared between xdist workers); pytest-timeout
# may be absent there, so its ini option is not a config error.
test-gpu:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -m accelerator -p no:cacheprovider \
		-W ignore::pytest.PytestConfigWarning -rs tests/accelerator

test-lowest: .venv-lowest-core/.divjac-installed .venv-lowest-jax/.divjac-installed
	.venv-lowest-core/bin/python -m pytest -n 2 tests/core src/divjac/_core
	.venv-lowest-jax/bin/python -m pytest -n 2 $(LOWEST_JAX_TESTS)

test-torch-floor: .venv-lowest-torch/.divjac-installed
	.venv-lowest-torch/bin/python -m pytest -n 2 $(TORCH_FLOOR_TESTS)

test-newest: .venv-newest-torch/.divjac-installed .venv-newest-jax/.divjac-installed \
		.venv-newest-core/.divjac-installed
	.venv-newest-torch/bin/python -m pytest -n 2 $(NEWEST_TORCH_TESTS)
	.venv-newest-jax/bin/python -m pytest -n 2 $(NEWEST_JAX_TESTS)
	.venv-newest-core/bin/python -m pytest -n 2 $(NEWEST_CORE_TESTS)

bench: install
	$(BIN)/divjac bench

bench-quick: install
	$(BIN)/divjac bench --quick

clean:
	rm -rf $(VENV) .venv-lowest-* .venv-newest-* divjac-demo bench-results .pytest_cache .mypy_cache .ruff_cache
