# sdtrt — see README.md. `make setup` once, then `make demo`, `make test`, `make engine`.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV ?= .venv
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU box.
TORCH_SPEC ?= torch==2.13.0
MODEL ?= tiny
TARGET ?= auto
ENGINES ?= engines
IMAGE ?= sdtrt:latest
# Inside the NVIDIA container there is no venv: use the image's Python, which has sdtrt installed.
PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

.PHONY: setup test test-slow lint demo engine bench docker-build docker-engine clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

test: setup
	$(VENV)/bin/python -m pytest

test-slow: setup
	$(VENV)/bin/python -m pytest -m slow -s

lint: setup
	$(VENV)/bin/ruff check sdtrt tests
	$(VENV)/bin/ruff format --check sdtrt tests
	$(VENV)/bin/mypy sdtrt

# The whole CPU chain on the tiny model: compile (ONNX Runtime target) → validate → generate.
demo: setup
	@set -e; engine=$$($(VENV)/bin/sdtrt compile --model tiny --target onnxruntime --engines $(ENGINES)); \
	$(VENV)/bin/sdtrt validate --model tiny --engine "$$engine"; \
	$(VENV)/bin/sdtrt generate --model tiny --engine "$$engine" --prompt "a lighthouse at dusk" --steps 20 --out out/demo.png; \
	echo "engine: $$engine"; echo "image:  out/demo.png (random weights: expect colourful noise)"

engine:
	$(PYTHON) -m sdtrt compile --model $(MODEL) --target $(TARGET) --engines $(ENGINES)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
