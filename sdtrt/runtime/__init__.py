"""Runtimes: one small interface over every backend that can run a component's graph.

base.py holds the contract (``Runtime``) and the checks every backend shares; one module per backend
(onnxruntime, torch, tensorrt, torchscript) implements it; ``open_runtime`` picks one for an artifact.
Runtimes sit just above the model sources: stages (a build checks its graph on ONNX Runtime), stand-ins
and tools use them, and they use nothing above.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ShapeProfile
from ..errors import ArtifactError
from .base import Runtime

if TYPE_CHECKING:
    from ..models import ModelSource
    from ..store import Artifact

__all__ = ["Runtime", "artifact_profile", "open_runtime"]


def artifact_profile(artifact: Artifact) -> ShapeProfile | None:
    data = artifact.manifest.get("profile")
    return ShapeProfile.from_json(data) if data else None


def open_runtime(artifact: Artifact, model: ModelSource | None = None, cuda_graph: bool = False) -> Runtime:
    """The runtime that runs this artifact: ONNX graphs on ONNX Runtime; plans on TensorRT; .ts on torch.

    ``model`` supplies the UNet's proportions for a bare .onnx that has no manifest; ``cuda_graph``
    replays TensorRT engines from CUDA graphs.
    """
    from ..onnx_graph import artifact_spec

    artifact.require_intact()
    spec = artifact_spec(artifact, model)
    if artifact.stage in ("export", "simplify", "external", "build-ort"):
        from ..config import target_precision_problem
        from .onnxruntime import OnnxRuntime

        if problem := target_precision_problem("onnxruntime", spec.precision):
            raise ArtifactError(f"{artifact.path}: {problem}")

        preoptimized = artifact.stage == "build-ort"
        return OnnxRuntime(artifact.primary, spec, artifact_profile(artifact), preoptimized=preoptimized)
    if artifact.stage == "build-trt":
        from .tensorrt import TensorRTRuntime

        return TensorRTRuntime(artifact.primary, spec, artifact.manifest, cuda_graph=cuda_graph)
    if artifact.stage == "wrap":
        from .torchscript import TorchScriptRuntime

        return TorchScriptRuntime(artifact.primary, spec, artifact_profile(artifact))
    raise ArtifactError(
        f"no runtime loads '{artifact.stage}' artifacts; pass an export, simplify, build or wrap artifact"
    )
