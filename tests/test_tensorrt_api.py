"""The TensorRT API surface sdtrt uses exists in the published API (checked without a GPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .helpers import REPO
from .trt_api import check_source, load_api

STUBS = Path(os.environ.get("SDTRT_TRT_STUBS", REPO / ".cache" / "trt-stubs"))
TRT_MODULES = ["sdtrt/gpu.py", "sdtrt/runtime/tensorrt.py", "sdtrt/trt_build_worker.py"]


@pytest.fixture(scope="module")
def api():
    if not (STUBS / "tensorrt_bindings" / "tensorrt.pyi").is_file():
        pytest.fail(f"TensorRT stubs not found in {STUBS}: run `make setup` (it unpacks tensorrt-stubs there)")
    return load_api(STUBS)


def test_every_module_that_imports_tensorrt_is_checked():
    importers = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "sdtrt").rglob("*.py") if "import tensorrt as trt" in p.read_text()
    )
    assert importers == sorted(TRT_MODULES)


def test_tensorrt_names_exist_in_the_published_api(api):
    problems, total = [], 0
    for module in TRT_MODULES:
        found, checked = check_source((REPO / module).read_text(), api)
        problems += [f"{module}: {p}" for p in found]
        total += checked
    assert problems == []
    assert total >= 40, f"only {total} TensorRT uses seen: is the checker still finding them?"


def test_checker_catches_misspelt_removed_and_wrong_keyword_calls(api):
    source = """
import tensorrt as trt
def f(engine: trt.ICudaEngine):
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    config: trt.IBuilderConfig = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_timing_cache(None, ignore_mismatches=False)
    builder.build_engine(None, config)
    engine.create_execution_contxt()
    trt.OnnxParsr

class Runner:
    def __init__(self, engine: trt.ICudaEngine):
        context: trt.IExecutionContext | None = engine.create_execution_context()
        self._context = context

    def run(self):
        self._context.execute_async_v2([], 0)
        self._context.set_binding_shape(0, (1,))
"""
    problems, _ = check_source(source, api)
    text = "\n".join(problems)
    assert "BuilderFlag.FP16 is removed" in text
    assert "has no parameter 'ignore_mismatches'" in text
    assert "Builder.build_engine is removed" in text or "has no member 'build_engine'" in text
    assert "has no member 'create_execution_contxt'" in text
    assert "trt.OnnxParsr does not exist" in text
    # an optional annotation, handed on to an attribute: the execution context's hot path is checked
    assert "IExecutionContext.execute_async_v2 is removed" in text or "has no member 'execute_async_v2'" in text
    assert "has no member 'set_binding_shape'" in text or "set_binding_shape is removed" in text


def test_refit_calls_are_checked(api):
    """The LoRA refit path (runtime/tensorrt.py set_weights, the worker's REFIT flag) is in the checked surface."""
    runtime = (REPO / "sdtrt/runtime/tensorrt.py").read_text()
    for call in ("refitter.set_named_weights(", "refitter.get_missing_weights()", "refitter.refit_cuda_engine()"):
        assert call in runtime
    assert "trt.BuilderFlag.REFIT)" in (REPO / "sdtrt/trt_build_worker.py").read_text()
    source = """
import tensorrt as trt
def f(engine: trt.ICudaEngine, logger: trt.ILogger):
    refitter: trt.Refitter = trt.Refitter(engine, logger)
    refitter.set_named_weight("w", trt.Weights())
    refitter.refit_cuda_engine(stream=0)
    trt.BuilderFlag.REFITTABLE
"""
    text = "\n".join(check_source(source, api)[0])
    assert "has no member 'set_named_weight'" in text
    assert "refit_cuda_engine() has no parameter 'stream'" in text
    assert "trt.BuilderFlag.REFITTABLE does not exist" in text
