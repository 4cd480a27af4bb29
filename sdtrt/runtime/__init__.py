"""Runtimes: one small interface over every backend that can run a component's graph.

base.py holds the contract (``Runtime``) and the checks every backend shares; one module per backend
(onnxruntime, torch, tensorrt, torchscript) implements it; ``open_runtime`` picks one for an artifact.
Runtimes sit just above the model sources: stages (a build checks its graph on ONNX Runtime), stand-ins
and tools use them, and they use nothing above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..core.config import ShapeProfile, WeightBudget
from ..core.errors import ArtifactError, RequestError
from .base import Runtime

if TYPE_CHECKING:
    from ..core.artifact import Artifact
    from ..sources.models import ModelSource
    from .device_memory import SharedDeviceMemory

__all__ = ["Runtime", "artifact_profile", "check_weight_budget", "open_members", "open_runtime"]


def artifact_profile(artifact: Artifact) -> ShapeProfile | None:
    data = artifact.manifest.get("profile")
    return ShapeProfile.from_json(data) if data else None


def streams_weights(artifact: Artifact) -> bool:
    """Whether the artifact is a TensorRT plan built with weight streaming (the only kind a budget applies to)."""
    return artifact.stage == "build-trt" and bool(artifact.manifest.get("config", {}).get("weight_streaming"))


def check_weight_budget(artifacts: Iterable[Artifact], weight_budget: WeightBudget | None) -> None:
    """A budget for engines none of which streams its weights would change nothing: RequestError, said plainly."""
    if weight_budget is not None and not any(streams_weights(a) for a in artifacts):
        raise RequestError(
            f"a weight streaming budget ({weight_budget.text}) applies to TensorRT engines built with "
            "--weight-streaming, and none of these was: rebuild with `sdtrt compile --target tensorrt "
            "--weight-streaming`, or leave the budget out"
        )


def open_runtime(
    artifact: Artifact, model: ModelSource | None = None, cuda_graph: bool = False,
    weight_budget: WeightBudget | None = None, device_memory: SharedDeviceMemory | None = None,
) -> Runtime:  # fmt: skip
    """The runtime that runs this artifact: ONNX graphs on ONNX Runtime; plans on TensorRT (or TensorRT-RTX, the
    product that built them); .ts on torch.

    ``model`` supplies the UNet's proportions for a bare .onnx that has no manifest; ``cuda_graph``
    replays TensorRT engines from CUDA graphs; ``weight_budget`` goes to engines built with weight streaming
    (others keep all their weights on the GPU: an engine set may stream only its largest member);
    ``device_memory`` is the activation buffer a TensorRT plan shares with the members it runs in turn with.
    """
    from ..graph.onnx_graph import ONNX_STAGES, artifact_spec

    artifact.require_intact()
    spec = artifact_spec(artifact, model)
    if artifact.stage in ONNX_STAGES:
        from ..core.config import target_precision_problem
        from .onnxruntime import OnnxRuntime

        if problem := target_precision_problem("onnxruntime", spec.precision):
            raise ArtifactError(f"{artifact.path}: {problem}")

        preoptimized = artifact.stage == "build-ort"
        return OnnxRuntime(artifact.primary, spec, artifact_profile(artifact), preoptimized=preoptimized)
    if artifact.stage == "build-trt":
        from .tensorrt import TensorRTRuntime

        budget = weight_budget if streams_weights(artifact) else None
        return TensorRTRuntime(
            artifact.primary, spec, artifact.manifest, cuda_graph, weight_budget=budget, device_memory=device_memory
        )
    if artifact.stage == "wrap":
        from .torchscript import TorchScriptRuntime

        return TorchScriptRuntime(artifact.primary, spec, artifact_profile(artifact))
    raise ArtifactError(
        f"no runtime loads '{artifact.stage}' artifacts; pass an export, simplify, build or wrap artifact"
    )


def open_members(
    members: Mapping[str, Artifact], model: ModelSource | None = None, weight_budget: WeightBudget | None = None,
    opened: Mapping[str, Runtime] | None = None,
) -> dict[str, Runtime]:  # fmt: skip
    """The runtimes of a pipeline's members (those not ``opened`` already), whose TensorRT plans share one
    activation buffer: a pipeline runs its members one after another (sdtrt.runtime.device_memory)."""
    from .device_memory import shared_for

    opened = opened or {}
    shared = shared_for(a for c, a in members.items() if c not in opened)
    return {
        c: opened.get(c) or open_runtime(a, model, weight_budget=weight_budget, device_memory=shared)
        for c, a in members.items()
    }
