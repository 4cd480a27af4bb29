"""Parity between an engine and the PyTorch fp32 reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .runtime import Runtime
    from .spec import UNetSpec


def tensor_stats(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """max abs, mean abs and cosine similarity of ``candidate`` against ``reference`` (in fp32)."""
    a = candidate.detach().float().flatten()
    b = reference.detach().float().flatten()
    finite = bool(torch.isfinite(a).all())
    diff = (a - b).abs()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item() if finite else float("nan")
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "cosine": cosine,
        "finite": finite,
    }


@dataclass(frozen=True)
class TensorCase:
    """One UNet call to compare: UNet batch (CFG-doubled), pixel size, timestep and seed."""

    unet_batch: int
    height: int
    width: int
    timestep: float = 500.0
    seed: int = 0

    def label(self) -> str:
        return f"b{self.unet_batch} {self.height}x{self.width} t={self.timestep:g}"


def compare_unet(runtime: Runtime, reference: torch.nn.Module, spec: UNetSpec, case: TensorCase) -> dict[str, Any]:
    """Run one case through the engine and the fp32 PyTorch UNet; stats of engine vs reference."""
    feeds = spec.sample_inputs(case.unet_batch, case.height, case.width, seed=case.seed, timestep=case.timestep)
    sample, timestep, text = (feeds[name] for name in spec.input_names)
    with torch.no_grad():
        expected = reference(sample, timestep, text, return_dict=False)[0]
    got = runtime.run(feeds)[spec.output_name]
    return {"case": case.label()} | tensor_stats(got, expected)
