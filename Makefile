# sdtrt — see README.md. `make setup` once, then `make demo`, `make test`, `make engine`.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV ?= .venv
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a CPU box.
# scripts/install_torch.py takes it from PyTorch's CPU index on a machine without an NVIDIA GPU.
TORCH_SPEC ?= torch==2.13.0
TRT_STUBS ?= tensorrt-stubs==10.13.0.35.1
MODEL ?= tiny
TARGET ?= auto
# The store: $SDTRT_ENGINES, as the CLI reads it, else ./engines.
ENGINES ?= $(or $(SDTRT_ENGINES),engines)
IMAGE ?= sdtrt:latest
TRITON_IMAGE ?= sdtrt-triton:latest
NGC_TAG ?= 25.01-py3
# `make serve`: the Triton model repository it writes and the address it serves on.
REPO ?= model_repository
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# A local model folder is mounted read-only at /model; presets and hub ids pass through as they are.
MODEL_DIR := $(shell test -d "$(MODEL)" && cd "$(MODEL)" && pwd)
DOCKER_MODEL := $(if $(MODEL_DIR),/model,$(MODEL))
DOCKER_MOUNTS := -v "$(abspath $(ENGINES))":/workspace/sdtrt/engines \
	-v "$(HOME)/.cache/sdtrt":/root/.cache/sdtrt -v "$(HOME)/.cache/huggingface":/root/.cache/huggingface \
	$(if $(MODEL_DIR),-v "$(MODEL_DIR)":/model:ro)
# Inside the NVIDIA container there is no venv: use the image's Python, which has sdtrt installed.
PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

.PHONY: setup test test-slow lint docs demo engine serve docker-build docker-engine docker-serve clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON_BOOT) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/python scripts/install_torch.py "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e '.[dev]'
	@# TensorRT's published Python API, for tests/test_tensorrt_api.py. Unpacked beside, not into,
	@# site-packages: a stub-only tensorrt/ folder would import as an empty package.
	$(VENV)/bin/pip download -q --no-deps --dest .cache "$(TRT_STUBS)"
	rm -rf .cache/trt-stubs && $(VENV)/bin/python -m zipfile -e .cache/tensorrt_stubs-*.whl .cache/trt-stubs
	@$(VENV)/bin/python -c 'import torch; print("installed: torch", torch.__version__, "with CUDA " + torch.version.cuda if torch.version.cuda else "(CPU build, no CUDA)")'
	touch $@

# Two workers (pytest-xdist), a test file each at a time, so module fixtures are built once; they share the
# session's store and models cache. A serial run keeps only ~1.3 of the CI machine's 2 cores busy.
test: setup
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile

test-slow: setup
	$(VENV)/bin/python -m pytest -m slow -s

lint: setup
	$(VENV)/bin/ruff check sdtrt tests benchmarks
	$(VENV)/bin/ruff format --check sdtrt tests benchmarks
	$(VENV)/bin/mypy sdtrt

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link or a missing page fails it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Wall time and peak RSS of preset → export → simplify → weight map → block parity on a big network, each step in
# its own process (benchmarks/big_export.py). Not part of `make test`.
BIG_MODEL ?= flux-random
.PHONY: bench-big
bench-big: setup
	$(VENV)/bin/python benchmarks/big_export.py --model $(BIG_MODEL)

# Wall time, peak RSS and output size of the ONNX Runtime and TensorRT-RTX builds of a model's fp16 UNet, each build
# in its own process, side by side (benchmarks/rtx_build.py; the store defaults to /tmp/rtxbench-store). Not part of
# `make test`.
RTX_MODEL ?= sd15-random
.PHONY: bench-rtx
bench-rtx: setup
	$(VENV)/bin/python benchmarks/rtx_build.py --model $(RTX_MODEL)

# The whole CPU chain on the tiny model: compile (ONNX Runtime target, validated once) → generate.
demo: setup
	@set -e; engine=$$($(VENV)/bin/sdtrt compile --model tiny --target onnxruntime --engines $(ENGINES)); \
	$(VENV)/bin/sdtrt generate --model tiny --engine "$$engine" --prompt "a lighthouse at dusk" --steps 20 --out out/demo.png; \
	echo "engine: $$engine"; echo "image:  out/demo.png (random weights: expect colourful noise)"

# The full chain for MODEL. TARGET=auto: TensorRT where a CUDA GPU and TensorRT are present (the
# container), else ONNX Runtime, and it says which and why. On a CPU machine run `make setup` first.
# TARGET=tensorrt-rtx: TensorRT for RTX plans, built here with or without a GPU (the dev extra installs it).
engine:
	$(PYTHON) -m sdtrt compile --model "$(MODEL)" --target $(TARGET) --engines "$(ENGINES)"

# Compile MODEL (a cache hit when built), deploy it into REPO and serve it on Triton until Ctrl-C.
# On a CPU machine run `make setup` first (the test tools include the serve extra); `sdtrt client` asks it.
serve:
	@set -e; engine=$$($(PYTHON) -m sdtrt compile --model "$(MODEL)" --target $(TARGET) --engines "$(ENGINES)"); \
	$(PYTHON) -m sdtrt deploy triton --engine "$$engine" --out "$(REPO)" --engines "$(ENGINES)"; \
	$(PYTHON) -m sdtrt serve "$(REPO)" --host $(HOST) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

docker-build:
	docker build -f docker/Dockerfile --build-arg NGC_TAG=$(NGC_TAG) -t $(IMAGE) .

docker-engine:
	mkdir -p "$(ENGINES)" "$(HOME)/.cache/sdtrt" "$(HOME)/.cache/huggingface"
	docker run --rm --gpus all $(DOCKER_MOUNTS) $(IMAGE) make engine MODEL="$(DOCKER_MODEL)" TARGET=$(TARGET) ENGINES=/workspace/sdtrt/engines

# `make serve` inside NGC's tritonserver image (docker/Dockerfile.triton) on the GPUs, ports 8000-8002.
docker-serve:
	docker build -f docker/Dockerfile.triton --build-arg TRITON_TAG=$(NGC_TAG) -t $(TRITON_IMAGE) .
	mkdir -p "$(ENGINES)" "$(HOME)/.cache/sdtrt" "$(HOME)/.cache/huggingface"
	docker run --rm --gpus all -p $(HTTP_PORT):8000 -p $(GRPC_PORT):8001 -p $(METRICS_PORT):8002 $(DOCKER_MOUNTS) $(TRITON_IMAGE) \
		make serve MODEL="$(DOCKER_MODEL)" TARGET=tensorrt ENGINES=/workspace/sdtrt/engines HOST=0.0.0.0

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
