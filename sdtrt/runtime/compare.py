"""Comparing outputs: tensor statistics, and two graphs of one component run side by side on ONNX Runtime.

Here, below the stages, because simplify and build-ort accept a graph only when it gives what its
input graph gives; validation (sdtrt.tools.validate) builds its PyTorch comparisons on the same statistics.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..spec import GraphSpec


def tensor_stats(candidate: torch.Tensor, reference: torch.Tensor) -> dict[str, Any]:
    """max abs, mean abs and cosine similarity of ``candidate`` against ``reference`` (in float64)."""
    a = candidate.detach().double().flatten().cpu()  # float64: no cosine above 1 from rounding
    b = reference.detach().double().flatten().cpu()
    finite = bool(torch.isfinite(a).all())
    diff = (a - b).abs()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item() if finite else float("nan")
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "cosine": cosine, "finite": finite}


def compare_graphs(reference: Path, candidate: Path, spec: GraphSpec) -> dict[str, Any]:
    """Run two graphs of one component on ONNX Runtime on one seeded input (batch 2, the profile's smallest size).

    Returns the stats of the output that agrees least (lowest cosine), named in ``output``.
    """
    from .onnxruntime import OnnxRuntime

    profile = spec.default_profile()
    feeds = spec.sample_inputs(2, profile.height.min, profile.width.min, seed=1)
    results = []
    for path in (reference, candidate):
        runtime = OnnxRuntime(path, spec, lean=True)  # one run each: no need for ORT's weight copies
        results.append(runtime.run(feeds))
        runtime.close()
    rows = [
        tensor_stats(results[1][name], results[0][name]) | {"output": name, "shape": list(results[0][name].shape)}
        for name in spec.output_names
    ]
    return min(rows, key=lambda row: row["cosine"] if row["finite"] else float("-inf"))
