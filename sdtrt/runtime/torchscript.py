"""TorchScript with an embedded TensorRT engine (``unet.ts`` from the wrap stage)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ShapeProfile
from ..gpu import require_torch_tensorrt
from ..spec import UNetSpec
from . import check_feeds


class TorchScriptRuntime:
    name = "torchscript"

    def __init__(self, path: Path, spec: UNetSpec, profile: ShapeProfile | None) -> None:
        require_torch_tensorrt("load a TorchScript-wrapped TensorRT engine")
        import torch_tensorrt  # noqa: F401  (registers the TensorRT engine class TorchScript needs)

        self.spec = spec
        self.profile = profile
        self._module = torch.jit.load(str(path), map_location="cuda")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def dtype(self) -> torch.dtype:
        return torch.float16 if self.spec.precision == "fp16" else torch.float32

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, self.profile, feeds)
        dtypes = {t.name: torch.float16 if t.dtype == "float16" else torch.float32 for t in self.spec.inputs()}
        inputs = [feeds[n].to(self.device, dtypes[n]).contiguous() for n in self.spec.input_names]
        (out,) = self._module(inputs)
        return {self.spec.output_name: out}

    def close(self) -> None:
        self._module = None
