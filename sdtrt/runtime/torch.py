"""PyTorch: the reference runtime (eager UNet2DConditionModel), behind the same interface."""

from __future__ import annotations

import torch

from ..core.config import ShapeProfile
from ..spec import UNetSpec
from .base import check_feeds


class TorchRuntime:
    name = "torch"

    def __init__(self, unet: torch.nn.Module, spec: UNetSpec, profile: ShapeProfile | None = None) -> None:
        self.unet = unet.eval()
        self.spec = spec
        self.profile = profile

    @property
    def device(self) -> torch.device:
        return next(self.unet.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.unet.parameters()).dtype

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feeds(self.spec, self.profile, feeds)
        sample, timestep, text = (feeds[n].to(self.device) for n in self.spec.input_names)
        with torch.no_grad():
            out = self.unet(sample.to(self.dtype), timestep, text.to(self.dtype), return_dict=False)[0]
        return {self.spec.output_name: out}

    def close(self) -> None:
        pass
