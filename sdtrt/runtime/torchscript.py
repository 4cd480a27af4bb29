"""TorchScript with an embedded TensorRT engine (``{component}.ts`` from the wrap stage)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.config import ShapeProfile
from ..core.gpu import require_torch_tensorrt
from ..spec import GraphSpec
from .base import CudaRuntime, check_feeds, typed_inputs


def named_outputs(
    spec: GraphSpec, result: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The engine's outputs by name from what the wrapped module returns.

    The module embed_engine_in_new_module builds takes one Tensor argument per engine input and returns
    a Tensor for one output, a tuple in binding order for several (pytorch/TensorRT core/compiler.cpp,
    AddEngineToGraph); the wrap stage passes the spec's output names as that order.
    """
    values = (result,) if isinstance(result, torch.Tensor) else tuple(result)
    return dict(zip(spec.output_names, values, strict=True))


class TorchScriptRuntime(CudaRuntime):
    name = "torchscript"

    def __init__(self, path: Path, spec: GraphSpec, profile: ShapeProfile | None) -> None:
        require_torch_tensorrt("load a TorchScript-wrapped TensorRT engine")
        import torch_tensorrt  # noqa: F401  (registers the TensorRT engine class TorchScript needs)

        self.spec = spec
        self.profile = profile
        # The engine is loaded onto the device current now and runs there: run() makes it current again, so the
        # inputs and the engine's work land on it whatever device the caller has made current since.
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._module = torch.jit.load(str(path), map_location=self._device)

    @property
    def device(self) -> torch.device:
        return self._device

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, self.profile, feeds)
        with torch.cuda.device(self._device):
            typed = typed_inputs(self.spec, feeds, self._device)
            return named_outputs(self.spec, self._module(*(typed[name] for name in self.spec.input_names)))

    def close(self) -> None:
        # The engine's memory must outlive the work queued on it (pyCoreDoc.h, execute_async_v3): drain first.
        torch.cuda.synchronize(self._device)
        self._module = None
