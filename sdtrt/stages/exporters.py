"""``torch.onnx.export`` as each exporter runs it: TorchScript's (traced on the smallest valid input, axes made
dynamic by name) and torch.export's (dynamo: traced on example inputs, real or fake, with dynamic shapes)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import ExportConfig
from ..graph.onnx_optimizer import multi_output_matches_by_use
from ..spec import GraphSpec

if TYPE_CHECKING:
    import torch

# Largest sizes torch.export may assume (others: 4096): Flux's patches reach 16384 at 2048² px.
AXIS_MAX = {"batch": 1024, "patches": 1 << 16, "text_tokens": 4096 + 77}


def _torch_export(
    module: torch.nn.Module, spec: GraphSpec, config: ExportConfig, exporter: str, path: Path, dtype: torch.dtype
) -> None:
    import torch

    pm = spec.pixel_multiple
    if exporter == "torchscript":
        # The TorchScript exporter runs the model for real; fp16 on a CPU without fp16 units is
        # slow, so trace the smallest valid input. The graph stays dynamic through dynamic_axes.
        side = max(8 * spec.vae_scale_factor, pm)
        example = spec.sample_inputs(1, side, side, dtype=dtype)
        torch.onnx.export(
            module, tuple(example.values()), str(path), dynamo=False, opset_version=config.opset,
            dynamic_axes=spec.dynamic_axes(), input_names=list(spec.input_names), output_names=list(spec.output_names),
        )  # fmt: skip
        return
    program = _dynamo_program(module, spec, config, dtype)
    program.save(str(path), external_data=True)  # what torch.onnx.export(f=path) does


def _dynamo_program(
    module: torch.nn.Module, spec: GraphSpec, config: ExportConfig, dtype: torch.dtype, fake_mode: Any = None
) -> Any:
    """torch.export's ONNXProgram for the module, traced on example inputs (fake ones in ``fake_mode``)."""
    import torch
    from torch.export import Dim

    # Distinct height and width (and a batch above 1) keep torch.export from specialising them;
    # an axis on a grid is a multiple of a free dimension, so the graph keeps that constraint.
    side = max(8 * spec.vae_scale_factor, spec.pixel_multiple)
    example = spec.sample_inputs(2, 2 * side, 3 * side, dtype=dtype)
    dims: dict[str, Any] = {}
    for axis in {d for t in spec.inputs() for d in t.shape if isinstance(d, str)}:
        multiple = getattr(spec, spec.grid[axis]) if axis in spec.grid else 1
        dims[axis] = multiple * Dim(axis, min=1, max=AXIS_MAX.get(axis, 4096))
    # torch's ONNX registry warns about every torchvision op it cannot register (sdtrt exports none).
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    # Keyed by the wrapper's one variadic parameter, ``inputs``.
    dynamic_shapes = {
        "inputs": tuple({i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} for t in spec.inputs())
    }
    # Static fake inputs: their dynamic axes are what dynamic_shapes says, as with real ones.
    inputs = tuple(fake_mode.from_tensor(t, static_shapes=True) if fake_mode else t for t in example.values())
    with multi_output_matches_by_use():  # its optimizer, linear in the graph: the same graph
        return torch.onnx.export(
            module, inputs, dynamo=True, opset_version=config.opset, verbose=False, dynamic_shapes=dynamic_shapes,
            input_names=list(spec.input_names), output_names=list(spec.output_names),
        )  # fmt: skip
