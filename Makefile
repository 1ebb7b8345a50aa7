# Two commands do all the set-up on a fresh machine:
#   make demo   the whole pipeline on the embedded engine (fixture model + sample data)
#   make test   lint + the whole test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/eaglet: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is pinned: pip takes the CPU wheel; other versions pull a CUDA build.
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/eaglet

.PHONY: install demo test test-fast lint
install: $(BIN)/eaglet

demo: install
	$(BIN)/eaglet demo --work-dir runs/demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not browser"
