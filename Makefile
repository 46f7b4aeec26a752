# Two commands on a fresh machine (nothing installed, no venv needed):
#   make demo   — build/reuse .venv, install, run the main job offline on embedded defaults
#   make test   — build/reuse .venv, install, run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
export TORCHAO_FORCE_SKIP_LOADING_SO_FILES ?= 1
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-fast test-matrix lint venv bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	# torch first, pinned to the version this machine has as a local CPU wheel; the project's range admits it.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.5,<3"
	$(PY) -m pip install -q -e ".[test,lint]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m distperp_harness demo

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=30 $(PYTEST_ARGS)

# the unit tests: no test of a module that starts processes, none marked distributed or slow; prints its time
test-fast: $(STAMP)
	@start=$$(date +%s); $(PY) -m pytest -q -x -m "not launches and not distributed and not slow" $(PYTEST_ARGS); \
	rc=$$?; echo "make test-fast: $$(( $$(date +%s) - start )) s"; exit $$rc

# every causal LM type transformers registers through distperp against float64 (benchmarks/family_matrix.py)
test-matrix: $(STAMP)
	$(PY) -m pytest -q -m matrix tests/test_family_matrix.py $(PYTEST_ARGS)

# ruff (format, import order, bugbear, simplify, complexity, argument count) and mypy over the whole package;
# the configuration is pyproject.toml's [tool.ruff] and [tool.mypy]
lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) -m benchmarks.bench_scoring

clean:
	rm -rf $(VENV) .cache
