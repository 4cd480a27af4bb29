"""TorchScript with an embedded TensorRT engine (``unet.ts`` from the wrap stage)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ShapeProfile
from ..gpu import require_torch_tensorrt
from ..spec import UNetSpec
from . import CudaRuntime, check_feeds, typed_inputs


def first_output(result: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """The engine's first output from what the wrapped module returns.

    The module embed_engine_in_new_module builds takes one Tensor argument per engine input and returns
    a Tensor for one output, a tuple for several (pytorch/TensorRT core/compiler.cpp, AddEngineToGraph).
    """
    return result if isinstance(result, torch.Tensor) else result[0]


class TorchScriptRuntime(CudaRuntime):
    name = "torchscript"

    def __init__(self, path: Path, spec: UNetSpec, profile: ShapeProfile | None) -> None:
        require_torch_tensorrt("load a TorchScript-wrapped TensorRT engine")
        import torch_tensorrt  # noqa: F401  (registers the TensorRT engine class TorchScript needs)

        self.spec = spec
        self.profile = profile
        self._module = torch.jit.load(str(path), map_location="cuda")

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, self.profile, feeds)
        typed = typed_inputs(self.spec, feeds, self.device)
        return {self.spec.output_name: first_output(self._module(*(typed[name] for name in self.spec.input_names)))}

    def close(self) -> None:
        self._module = None
