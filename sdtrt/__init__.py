"""sdtrt: make Stable Diffusion fast on NVIDIA GPUs.

Export a diffusers model's networks to ONNX, simplify them, build TensorRT, TensorRT-RTX or ONNX Runtime engines,
and drop them into the family's own diffusers pipeline, validated against PyTorch.

The public API is importable from here (``from sdtrt import load_pipeline, compile_model``). Each name is imported
on first use (PEP 562), so that ``import sdtrt`` and the CLI's ``--help`` load no torch, diffusers or ONNX.
The folders below are the layers, bottom to top: core, sources, spec, graph, runtime, stages, lora, standins,
pipeline, tools, serving, cli; a module imports only from its own layer or below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name → the module that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(("load_pipeline", "set_loras", "generate", "set_scheduler"), "sdtrt.pipeline.loading"),
    "GenerateRequest": "sdtrt.pipeline.request",
    "DeepCache": "sdtrt.pipeline.deepcache",
    **dict.fromkeys(("compile_model", "CompileResult"), "sdtrt.tools.compile"),
    **dict.fromkeys(("validate", "ValidationReport"), "sdtrt.tools.validate"),
    "run_bench": "sdtrt.tools.bench",
    "profile_generation": "sdtrt.tools.profile",
    **dict.fromkeys(("debug", "DebugConfig", "DebugReport"), "sdtrt.tools.debug"),
    **dict.fromkeys(("guard", "GuardConfig", "GuardReport"), "sdtrt.tools.guard"),
    **dict.fromkeys(("write_report", "ReportConfig"), "sdtrt.tools.report"),
    **dict.fromkeys(("deploy_triton", "TritonDeployConfig"), "sdtrt.serving.deploy"),
    **dict.fromkeys(("start_server", "ServeConfig"), "sdtrt.serving.serve"),
    **dict.fromkeys(("resolve_model", "ModelSource"), "sdtrt.sources.models"),
    "Store": "sdtrt.core.store",
    "Artifact": "sdtrt.core.artifact",
    "ExportConfig": "sdtrt.core.config.export",
    "SimplifyConfig": "sdtrt.core.config.simplify",
    "QuantizeConfig": "sdtrt.core.config.quantize",
    **dict.fromkeys(("OrtBuildConfig", "TrtBuildConfig", "WrapConfig"), "sdtrt.core.config.build"),
    "ValidationConfig": "sdtrt.core.config.validation",
    "BenchConfig": "sdtrt.core.config.bench",
    "ShapeProfile": "sdtrt.core.config.shapes",
    **dict.fromkeys(
        (
            "SdtrtError",
            "ModelNotFoundError",
            "UnsupportedModelError",
            "ConfigError",
            "RequestError",
            "ArtifactError",
            "ArtifactNotFoundError",
            "WrongArtifactError",
            "StoreError",
            "ExportError",
            "SimplifyError",
            "BuildError",
            "EnvironmentMismatchError",
            "EngineMismatchError",
            "MissingDependencyError",
            "EngineInputError",
            "LoraError",
            "LoraFamilyError",
            "RefitError",
            "ServeError",
            "ServeAddressError",
            "BenchError",
            "ParityError",
        ),
        "sdtrt.core.errors",
    ),
}
# The stages, as modules: each has ``run(config, input, store) -> Artifact`` (``from sdtrt import export``).
_STAGES = ("export", "simplify", "quantize", "build_ort", "build_trt", "wrap", "engine_set")
__all__ = ["__version__", *_EXPORTS, *_STAGES]

if TYPE_CHECKING:  # the same names for type checkers and IDEs (ruff: F401 is off for this file)
    from sdtrt.core.artifact import Artifact
    from sdtrt.core.config.bench import BenchConfig
    from sdtrt.core.config.build import OrtBuildConfig, TrtBuildConfig, WrapConfig
    from sdtrt.core.config.export import ExportConfig
    from sdtrt.core.config.quantize import QuantizeConfig
    from sdtrt.core.config.shapes import ShapeProfile
    from sdtrt.core.config.simplify import SimplifyConfig
    from sdtrt.core.config.validation import ValidationConfig
    from sdtrt.core.errors import (
        ArtifactError,
        ArtifactNotFoundError,
        BenchError,
        BuildError,
        ConfigError,
        EngineInputError,
        EngineMismatchError,
        EnvironmentMismatchError,
        ExportError,
        LoraError,
        LoraFamilyError,
        MissingDependencyError,
        ModelNotFoundError,
        ParityError,
        RefitError,
        RequestError,
        SdtrtError,
        ServeAddressError,
        ServeError,
        SimplifyError,
        StoreError,
        UnsupportedModelError,
        WrongArtifactError,
    )
    from sdtrt.core.store import Store
    from sdtrt.pipeline.deepcache import DeepCache
    from sdtrt.pipeline.loading import generate, load_pipeline, set_loras, set_scheduler
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.serving.serve import ServeConfig, start_server
    from sdtrt.sources.models import ModelSource, resolve_model
    from sdtrt.stages import build_ort, build_trt, engine_set, export, quantize, simplify, wrap
    from sdtrt.tools.bench import run_bench
    from sdtrt.tools.compile import CompileResult, compile_model
    from sdtrt.tools.debug import DebugConfig, DebugReport, debug
    from sdtrt.tools.guard import GuardConfig, GuardReport, guard
    from sdtrt.tools.profile import profile_generation
    from sdtrt.tools.report import ReportConfig, write_report
    from sdtrt.tools.validate import ValidationReport, validate


def __getattr__(name: str) -> Any:
    if name in _STAGES:
        value = importlib.import_module(f"sdtrt.stages.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'sdtrt' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
