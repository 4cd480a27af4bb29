"""Runtimes: one small interface over every backend that can run a component's graph.

A runtime takes a dict of named torch tensors and returns a dict of named torch tensors. It knows
its spec, device and compute dtype, and checks every request against the shapes it was built for
before running it, so a bad request is a clear EngineInputError, not a crash deep in a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..config import ShapeProfile
from ..errors import ArtifactError, EngineInputError

if TYPE_CHECKING:
    from ..models import ModelSource
    from ..spec import GraphSpec
    from ..store import Artifact


class Runtime(Protocol):
    name: str

    @property
    def spec(self) -> GraphSpec: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in (and wants sample/encoder_hidden_states in)."""
        ...

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "int32": torch.int32, "int64": torch.int64}


def typed_inputs(spec: GraphSpec, feeds: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Inputs in the graph's dtypes, contiguous, on ``device`` (no copy when they already are)."""
    return {t.name: feeds[t.name].detach().to(device, TORCH_DTYPES[t.dtype]).contiguous() for t in spec.inputs()}


class CudaRuntime:
    """Device and dtype of runtimes that run on the current CUDA device (TensorRT, TorchScript)."""

    spec: GraphSpec

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]


def check_feeds(spec: GraphSpec, profile: ShapeProfile | None, feeds: dict[str, torch.Tensor]) -> None:
    """Raise EngineInputError unless ``feeds`` are tensors of the right kind whose shapes the engine takes."""
    kinds = {t.name: t.dtype.startswith("float") for t in spec.inputs()}
    for name, tensor in feeds.items():
        if name not in kinds:
            raise EngineInputError(f"unexpected input '{name}'; the engine takes {list(spec.input_names)}")
        if tensor.is_floating_point() != kinds[name]:
            wanted = "floating-point" if kinds[name] else "integer"
            raise EngineInputError(f"input '{name}' is {tensor.dtype}; the engine takes {wanted} tensors")
    reason = spec.check_shapes({name: tuple(t.shape) for name, t in feeds.items()}, profile)
    if reason:
        raise EngineInputError(f"{reason}; rebuild the engine with --batch/--height/--width covering it")


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
        from .onnxruntime import OnnxRuntime

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
