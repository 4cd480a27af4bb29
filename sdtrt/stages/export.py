"""Export stage: a diffusers UNet → ``unet.onnx`` (+ ``unet.onnx.data`` over 2 GB).

Inputs ``sample``, ``timestep`` (float32 ``[2B]``), ``encoder_hidden_states``; output ``out_sample``;
batch, height and width dynamic. Export-time patches are scoped and recorded in the manifest.
"""

from __future__ import annotations

import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import onnx_graph
from ..config import ExportConfig
from ..errors import ExportError, one_line
from ..models import ModelSource, load_unet
from ..progress import step
from ..spec import UNetSpec
from ..store import Artifact, StageRequest, Store, environment

if TYPE_CHECKING:
    import torch

STAGE = "export"
VERSION = 1
ONNX_NAME = "unet.onnx"


def _graph_module(unet: torch.nn.Module) -> torch.nn.Module:
    """The UNet with positional tensor inputs and a single tensor output, as the graph has them."""
    import torch

    class UNetGraph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unet = unet

        def forward(
            self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
        ) -> torch.Tensor:
            return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    return UNetGraph().eval()


def spec_for(model: ModelSource, config: ExportConfig) -> UNetSpec:
    return UNetSpec.from_config(model.unet_config(), model.vae_scale_factor(), config.precision, config.io_naming)


def run(config: ExportConfig, model: ModelSource, store: Store) -> Artifact:
    spec = spec_for(model, config)
    store.ensure_writable()
    request = StageRequest(
        stage=STAGE,
        version=VERSION,
        config=config,
        inputs=[{"kind": "model", "digest": model.unet_digest(), **model.describe()}],
        environment=environment("torch", "diffusers", "onnx", "onnxscript"),
    )
    artifact, _ = store.produce(request, lambda out_dir: _export(config, model, spec, out_dir))
    return artifact


def _export(config: ExportConfig, model: ModelSource, spec: UNetSpec, out_dir: Path) -> dict[str, Any]:
    import torch

    from ..patches import export_patches

    dtype = torch.float16 if config.precision == "fp16" else torch.float32
    timings: dict[str, float] = {}
    started = time.perf_counter()
    with step(f"Loading UNet from {model.name}"):
        graph_module = _graph_module(load_unet(model, dtype))
    timings["load_s"] = round(time.perf_counter() - started, 3)

    raw_dir = out_dir / "raw"
    raw_dir.mkdir()
    started = time.perf_counter()
    description = f"Exporting UNet to ONNX ({config.precision}, {config.exporter} exporter, opset {config.opset})"
    with step(description), export_patches() as patches, torch.no_grad(), warnings.catch_warnings():
        # The tracer warns about every Python branch on a shape; the graph is checked numerically.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            _torch_export(graph_module, spec, config, raw_dir / ONNX_NAME, dtype)
        except Exception as exc:
            other = "torchscript" if config.exporter == "dynamo" else "dynamo"
            raise ExportError(
                f"the {config.exporter} exporter failed: {one_line(exc)}; try --exporter {other}, "
                "or SDTRT_DEBUG=1 for the traceback"
            ) from exc
    timings["export_s"] = round(time.perf_counter() - started, 3)
    del graph_module

    started = time.perf_counter()
    with step("Naming axes, packing weights and checking the graph"):
        onnx_path = out_dir / ONNX_NAME
        proto = onnx_graph.load_graph(raw_dir / ONNX_NAME, with_weights=True)
        onnx_graph.name_dynamic_axes(proto, spec)
        weight_bytes = onnx_graph.weights_on_disk(raw_dir)
        onnx_graph.save(proto, onnx_path, weight_bytes)
        node_count = len(proto.graph.node)
        del proto
        shutil.rmtree(raw_dir)
        onnx_graph.check(onnx_path)
    timings["finalize_s"] = round(time.perf_counter() - started, 3)

    return {
        "primary": ONNX_NAME,
        "io": spec.to_json(),
        "patches": patches,
        "timings": timings,
        "details": {
            "nodes": node_count,
            "external_data": onnx_graph.data_file(onnx_path).exists(),
            "unet_config": model.unet_config(),
        },
        "reproduce": (
            f"sdtrt export --model {model.name} --precision {config.precision} --exporter {config.exporter} "
            f"--opset {config.opset} --io-naming {config.io_naming}"
        ),
    }


def _torch_export(
    module: torch.nn.Module, spec: UNetSpec, config: ExportConfig, path: Path, dtype: torch.dtype
) -> None:
    import torch

    m = spec.latent_multiple
    output_names = [spec.output_name]
    if config.exporter == "torchscript":
        # The TorchScript exporter runs the model for real; fp16 on a CPU without fp16 units is
        # slow, so trace the smallest valid input. The graph stays dynamic through dynamic_axes.
        side = max(8, m) * spec.vae_scale_factor
        example = spec.sample_inputs(1, side, side, dtype=dtype)
        torch.onnx.export(
            module, tuple(example.values()), str(path), dynamo=False, opset_version=config.opset,
            input_names=list(spec.input_names), output_names=output_names, dynamic_axes=spec.dynamic_axes(),
        )  # fmt: skip
        return
    from torch.export import Dim

    # Distinct height and width (and a batch above 1) keep torch.export from specialising them.
    example = spec.sample_inputs(2, 2 * m * spec.vae_scale_factor, 3 * m * spec.vae_scale_factor, dtype=dtype)
    batch, height, width = Dim("batch", min=1, max=1024), Dim("height", min=1, max=4096), Dim("width", min=1, max=4096)
    dynamic_shapes = {
        "sample": {0: batch, 2: m * height, 3: m * width},
        "timestep": {0: batch},
        "encoder_hidden_states": {0: batch},
    }
    torch.onnx.export(
        module, tuple(example.values()), str(path), dynamo=True, opset_version=config.opset,
        input_names=list(spec.input_names), output_names=output_names, dynamic_shapes=dynamic_shapes,
    )  # fmt: skip
