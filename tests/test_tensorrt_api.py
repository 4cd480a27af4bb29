"""The TensorRT API surface sdtrt uses exists in the published API (checked without a GPU)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from .helpers import REPO
from .trt_api import Signature, check_source, load_api

STUBS = Path(os.environ.get("SDTRT_TRT_STUBS", REPO / ".cache" / "trt-stubs"))
RUNTIME_MODULES = [
    "sdtrt/runtime/tensorrt.py",
    "sdtrt/runtime/trt_engine_io.py",
    "sdtrt/runtime/trt_refill.py",
    "sdtrt/runtime/trt_refit.py",
    "sdtrt/runtime/trt_weight_streaming.py",
]
TRT_MODULES = ["sdtrt/core/gpu.py", *RUNTIME_MODULES, "sdtrt/stages/trt_build_worker.py"]


def runtime_source() -> str:
    """The TensorRT runtime's modules (runtime/tensorrt.py and the trt_* modules it imports), as one text."""
    return "\n".join((REPO / module).read_text() for module in RUNTIME_MODULES)


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


def test_checker_catches_misspelt_removed_and_wrongly_called_names(api):
    source = """
import tensorrt as trt
def f(engine: trt.ICudaEngine):
    builder = trt.Builder(trt.Logger(trt.Logger.WARNING))
    config: trt.IBuilderConfig = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_timing_cache(None, ignore_mismatches=False)
    builder.build_engine(None, config)
    engine.create_execution_contxt()
    engine.serialize_with_config(arg0=None)
    trt.OnnxParsr

class Runner:
    def __init__(self, engine: trt.ICudaEngine):
        context: trt.IExecutionContext | None = engine.create_execution_context()
        self._context = context

    def run(self):
        self._context.execute_async_v2([], 0)
        self._context.set_binding_shape(0, (1,))
        self._context.set_optimization_profile_async(0)
        self._context.set_tensor_address("x", 0, name="y")
        trt.Refitter(self._context, None, None)
        trt.ICudaEngine()
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
    # argument counts and required parameters, constructors included
    assert "set_optimization_profile_async() misses 'stream_handle'" in text
    assert "set_tensor_address() gets 'name' twice" in text
    assert "Refitter() takes 2 arguments, not 3" in text
    assert "ICudaEngine() has no Python constructor" in text
    assert "serialize_with_config() has no parameter 'arg0'" in text  # pybind11's unnamed arguments


def test_refit_calls_are_checked(api):
    """The LoRA refit path (runtime/tensorrt.py set_weights, the worker's REFIT flag) is in the checked surface."""
    runtime = runtime_source()
    for call in ("refitter.set_named_weights(", "refitter.get_missing_weights()", "refitter.refit_cuda_engine()"):
        assert call in runtime
    assert "trt.BuilderFlag.REFIT)" in (REPO / "sdtrt/stages/trt_build_worker.py").read_text()
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


# torch-tensorrt has no stubs and no wheel that installs here: its calls are pinned to the signatures read in
# pytorch/TensorRT py/torch_tensorrt (ts/_compiler.py embed_engine_in_new_module, the same from 2.4 to HEAD;
# _Device.py Device.__init__(*args, **kwargs), whose keywords are these four; sdtrt passes keywords only).
# A new call fails here until it is read and added.
TORCH_TENSORRT_CALLS = {
    "ts.embed_engine_in_new_module": Signature(
        ("serialized_engine", "input_binding_names", "output_binding_names", "device"),
        frozenset({"serialized_engine"}),
        variadic=False,
    ),
    "Device": Signature(("gpu_id", "dla_core", "allow_gpu_fallback", "device_type"), frozenset(), variadic=False),
}


def torch_tensorrt_call_problems(source: str) -> tuple[list[str], int]:
    problems, checked = [], 0
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        parts: list[str] = []
        func = node.func
        while isinstance(func, ast.Attribute):
            parts.insert(0, func.attr)
            func = func.value
        if not (isinstance(func, ast.Name) and func.id == "torch_tensorrt"):
            continue
        checked += 1
        name = ".".join(parts)
        if name not in TORCH_TENSORRT_CALLS:
            problems.append(f"line {node.lineno}: torch_tensorrt.{name} is not a call whose signature was read")
        elif name == "Device" and node.args:
            problems.append(f"line {node.lineno}: torch_tensorrt.Device() takes keywords here (gpu_id=…)")
        elif problem := TORCH_TENSORRT_CALLS[name].problem(len(node.args), [k.arg for k in node.keywords if k.arg]):
            problems.append(f"line {node.lineno}: torch_tensorrt.{name}() {problem}")
    return problems, checked


def test_torch_tensorrt_calls_match_the_signatures_read():
    problems, checked = [], 0
    for module in (REPO / "sdtrt").rglob("*.py"):
        found, count = torch_tensorrt_call_problems(module.read_text())
        problems += [f"{module.relative_to(REPO)}: {p}" for p in found]
        checked += count
    assert problems == [] and checked >= 2  # wrap.py: embed_engine_in_new_module and its Device
    wrong = """
import torch_tensorrt
torch_tensorrt.ts.embed_engine_in_new_module(b"", ["x"], input_binding_names=["x"])
torch_tensorrt.ts.embed_engine_in_new_module(device_id=0)
torch_tensorrt.ts.embed_engine_in_new_module(input_binding_names=["x"])
torch_tensorrt.Device(gpu=0)
torch_tensorrt.Device(0)
torch_tensorrt.ts.compile(None)
"""
    text = "\n".join(torch_tensorrt_call_problems(wrong)[0])
    assert "gets 'input_binding_names' twice" in text and "has no parameter 'device_id'" in text
    assert "misses 'serialized_engine'" in text
    assert "Device() has no parameter 'gpu'" in text and "Device() takes keywords here" in text
    assert "torch_tensorrt.ts.compile is not a call whose signature was read" in text


def test_weight_streaming_and_bf16_calls_are_checked(api):
    """Issue 20: the weight streaming flag and budget calls and the bf16 dtype are in the checked surface."""
    runtime = runtime_source()
    for use in (
        "engine.streamable_weights_size",
        "engine.weight_streaming_budget_v2 = ",
        "engine.get_weight_streaming_automatic_budget",
        "trt.DataType.BF16",
    ):
        assert use in runtime
    assert "trt.BuilderFlag.WEIGHT_STREAMING)" in (REPO / "sdtrt/stages/trt_build_worker.py").read_text()
    source = """
import tensorrt as trt
def f(engine: trt.ICudaEngine):
    engine.weight_streaming_budget_v3 = 0
    trt.DataType.BFLOAT16
"""
    text = "\n".join(check_source(source, api)[0])
    assert "has no member 'weight_streaming_budget_v3'" in text
    assert "trt.DataType.BFLOAT16 does not exist" in text


def test_weight_stripping_calls_are_checked(api):
    """Issue 21: the strip flags and the ONNX refitter are in the checked surface, and misuses of them are caught."""
    worker = (REPO / "sdtrt/stages/trt_build_worker.py").read_text()
    for use in ("trt.BuilderFlag.STRIP_PLAN)", "trt.BuilderFlag.REFIT_IDENTICAL)", "parser.parse_from_file("):
        assert use in worker
    runtime = runtime_source()
    for use in (
        "trt.OnnxParserRefitter(refitter, logger)",
        "parser.refit_from_file(",
        "parser.get_error(",
        "parser.num_errors",
        "refitter.get_missing_weights()",
        "refitter.refit_cuda_engine()",
    ):
        assert use in runtime
    source = """
import tensorrt as trt
def f(engine: trt.ICudaEngine, logger: trt.ILogger, config: trt.IBuilderConfig):
    config.set_flag(trt.BuilderFlag.STRIP_WEIGHTS)
    config.set_flag(trt.BuilderFlag.WEIGHTLESS_IDENTICAL)
    refitter: trt.Refitter = trt.Refitter(engine, logger)
    parser: trt.OnnxParserRefitter = trt.OnnxParserRefitter(refitter)
    parser.refit_from_file("unet.onnx", "unet.onnx.data")
    parser.refit_from_path("unet.onnx")
    parser.errors
"""
    text = "\n".join(check_source(source, api)[0])
    assert "trt.BuilderFlag.STRIP_WEIGHTS does not exist" in text
    assert "trt.BuilderFlag.WEIGHTLESS_IDENTICAL does not exist" in text
    assert "OnnxParserRefitter() misses 'logger'" in text
    assert "refit_from_file() takes 1 arguments, not 2" in text
    assert "has no member 'refit_from_path'" in text and "has no member 'errors'" in text
