"""The whole chain for one model: export → simplify → build (→ wrap), per target."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from .config import ExportConfig, OrtBuildConfig, OrtOptimization, ShapeProfile, SimplifyConfig, Target
from .errors import MissingDependencyError
from .models import ModelSource
from .onnx_graph import artifact_spec
from .stages import build_ort, export, simplify
from .store import Artifact, Store

CONTAINER_HINT = "build engines inside the NVIDIA container: `make docker-build && make docker-engine MODEL=…`"


@dataclass(frozen=True)
class CompileResult:
    """Every artifact the chain produced, in order; ``final`` is what a runtime loads."""

    target: str
    target_reason: str
    artifacts: list[Artifact] = field(default_factory=list)

    @property
    def final(self) -> Artifact:
        return self.artifacts[-1]


def tensorrt_missing() -> str | None:
    """What stops a TensorRT build on this machine, or None when nothing does."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    if importlib.util.find_spec("tensorrt") is None:
        return "the tensorrt Python package is not installed"
    return None


def resolve_target(target: Target) -> tuple[str, str]:
    """The concrete target and a sentence saying why it was chosen."""
    missing = tensorrt_missing()
    if target == "auto":
        if missing is None:
            return "tensorrt", "auto: a CUDA GPU and TensorRT are present"
        return "onnxruntime", f"auto: {missing}, so the ONNX Runtime target was chosen"
    if target == "tensorrt" and missing is not None:
        raise MissingDependencyError(f"cannot build a TensorRT engine here: {missing}; {CONTAINER_HINT}")
    return target, f"{target}: requested"


def build(
    source: Artifact,
    store: Store,
    target: Target = "auto",
    profile: ShapeProfile | None = None,
    ort_optimization: OrtOptimization = "extended",
) -> tuple[Artifact, str]:
    """Build an engine for ``target`` from an ONNX artifact; returns it and why that target was used."""
    _, reason = resolve_target(target)
    profile = profile or artifact_spec(source).default_profile()
    return build_ort.run(OrtBuildConfig(profile=profile, optimization=ort_optimization), source, store), reason


def compile_model(
    model: ModelSource,
    store: Store,
    target: Target = "auto",
    export_config: ExportConfig = ExportConfig(),
    simplify_config: SimplifyConfig = SimplifyConfig(),
    profile: ShapeProfile | None = None,
) -> CompileResult:
    resolve_target(target)  # fail before exporting when the target cannot be built here
    exported = export.run(export_config, model, store)
    simplified = simplify.run(simplify_config, exported, store)
    built, reason = build(simplified, store, target, profile)
    return CompileResult(built.manifest["target"], reason, [exported, simplified, built])
