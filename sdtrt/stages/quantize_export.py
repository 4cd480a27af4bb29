"""The quantized denoiser exported to its two ONNX graphs, TensorRT's and ONNX Runtime's (quantize.py says why two).

Exported as ModelOpt's diffusers example exports it (onnx_utils/export.py ``modelopt_export_sd``: TorchScript
exporter, opset 20; for FP8 ``generate_fp8_scales`` then ``convert_zp_fp8``): the fp32 graph first, then the network
cast to 16 bits in place (``as_16_bit``) and exported again, so the weights are never held twice.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import ExportConfig, Precision, QuantizeConfig
from ..core.errors import ExportError, one_line
from ..core.progress import quiet_loading, step
from ..graph import onnx_graph
from ..spec import GraphSpec
from .exporters import _torch_export
from .graph_module import graph_module
from .qdq import _cleaned, convert_zp_fp8, standard_fp8_qdq
from .quantize_layers import _quiet

if TYPE_CHECKING:
    import torch

# ModelOpt's diffusers example exports with opset 20; FP8 QuantizeLinear needs 19 or later.
OPSET = 20
GRAPH = "{component}.onnx"  # unet.onnx, transformer.onnx
TRT_GRAPH = "{component}.trt.onnx"


def write_graphs(
    network: torch.nn.Module,
    config: QuantizeConfig,
    members: dict[str, dict[str, GraphSpec]],
    out_dir: Path,
    timings: dict[str, float],
) -> dict[str, dict[str, str]]:
    """Export a quantized network as each role's spec asks (``graph_specs``) into ``out_dir``, for each member: the
    denoiser, and the split members a step cache needs, cut from the same calibrated network (the same scales).
    Returns each member's file by role and adds the steps' times to ``timings``.

    The network is changed in place: FP8 scales as ModelOpt's example exports them, then cast to the TensorRT graph's
    16-bit type after the fp32 exports (it is left so)."""
    if config.precision == "fp8":
        fp8_scales_as_int8(network)
    files: dict[str, dict[str, str]] = {component: {} for component in members}
    trt, ort = (next(iter(members.values()))[role] for role in ("tensorrt", "onnxruntime"))
    if trt.precision == ort.precision:  # level 4: one 16-bit export for both
        as_16_bit(network, trt.precision)
        return {
            component: _export_graphs(network, config, specs["tensorrt"], out_dir, timings, ("tensorrt", "onnxruntime"))
            for component, specs in members.items()
        }
    for component, specs in members.items():
        files[component] |= _export_graphs(network, config, specs["onnxruntime"], out_dir, timings, ("onnxruntime",))
    as_16_bit(network, trt.precision)  # in place: the weights are never held twice
    for component, specs in members.items():
        files[component] |= _export_graphs(network, config, specs["tensorrt"], out_dir, timings, ("tensorrt",))
    return files


def _export_graphs(
    network: torch.nn.Module,
    config: QuantizeConfig,
    spec: GraphSpec,
    out_dir: Path,
    timings: dict[str, float],
    roles: tuple[str, ...],
) -> dict[str, str]:
    """One export of the network as ``spec``, written as the graph of each of ``roles``: the TensorRT graph keeps
    ModelOpt's trt:: FP8 ops, ONNX Runtime's has them rewritten; where there are none one file serves both."""
    started = time.perf_counter()
    graph, trt_graph = GRAPH.format(component=spec.component), TRT_GRAPH.format(component=spec.component)
    raw_dir = out_dir / "raw"
    raw_dir.mkdir()
    with step(f"Exporting the quantized {spec.label} in {spec.precision} (TorchScript exporter, opset {OPSET})"):
        _export(network, spec, raw_dir / graph)
    _add_time(timings, "export_s", started)

    started = time.perf_counter()
    with step(f"Writing the {' and '.join(ROLE_NAMES[role] for role in roles)} graph"):
        proto = onnx_graph.load_graph(raw_dir / graph, with_weights=True)
        onnx_graph.name_dynamic_axes(proto, spec)
        weight_bytes = onnx_graph.weights_on_disk(raw_dir)
        shutil.rmtree(raw_dir)  # its weights are in memory now: one copy on disk at a time (SD 1.5: 3.4 GB)
        if config.precision == "fp8":
            proto = convert_zp_fp8(_cleaned(proto))
        files = {}
        if "onnxruntime" not in roles:
            onnx_graph.save(proto, out_dir / trt_graph, weight_bytes)
            files["tensorrt"] = trt_graph
        else:
            if "tensorrt" in roles and any(node.domain == "trt" for node in proto.graph.node):  # level 4's FP8 ops
                onnx_graph.save_keeping_weights(proto, out_dir / trt_graph, weight_bytes)
                files["tensorrt"] = trt_graph
            standard_fp8_qdq(proto)
            onnx_graph.save(proto, out_dir / graph, weight_bytes)
            files = {role: graph for role in roles} | files
        del proto
        if spec.precision == "bf16":  # TensorRT builds this graph as it is (no simplify stage applies the passes)
            from .graph_passes import compute_in_fp32_file

            compute_in_fp32_file(out_dir / files["tensorrt"])
        for name in set(files.values()):
            onnx_graph.check(out_dir / name)
    _add_time(timings, "finalize_s", started)
    return files


ROLE_NAMES = {"tensorrt": "TensorRT", "onnxruntime": "ONNX Runtime"}


def _add_time(timings: dict[str, float], name: str, started: float) -> None:
    timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - started, 3)


def _export(network: torch.nn.Module, spec: GraphSpec, path: Path) -> None:
    """ModelOpt's fake-quant modules export their Q/DQ through the TorchScript exporter only (torch.export fails
    on them as shipped)."""
    import torch

    from .patches import export_patches

    module = graph_module(spec, network)
    config = ExportConfig(precision=spec.precision, opset=OPSET, exporter="torchscript", component=spec.component)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision, torch.float32)
    with export_patches("torchscript"), torch.no_grad(), _quiet():
        try:
            _torch_export(module, spec, config, "torchscript", path, dtype)
        except Exception as exc:
            raise ExportError(f"exporting the quantized {spec.label} failed: {one_line(exc)}") from exc


def fp8_scales_as_int8(network: torch.nn.Module) -> None:
    """ModelOpt's diffusers example's ``generate_fp8_scales``: the FP8 Linear/Conv quantizers export as INT8 Q/DQ
    whose scale is the FP8 one (amax·127/448 over 127 = amax/448); ``convert_zp_fp8`` then makes them FP8 Q/DQ.
    Changes the module in place: only for export."""
    import torch

    for module in network.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Conv2d) and hasattr(module, "input_quantizer"):
            quantizers: tuple[Any, ...] = (module.input_quantizer, module.weight_quantizer)
            for quantizer in quantizers:
                if quantizer.is_enabled and getattr(quantizer, "_amax", None) is not None:
                    quantizer._num_bits = 8
                    quantizer._amax = quantizer._amax * (127 / 448.0)


def as_16_bit(network: torch.nn.Module, precision: Precision) -> None:
    """Cast a network calibrated in fp32 to ``precision`` (fp16, bf16), its Q/DQ in that type too, in place: as NVIDIA
    exports 8-bit denoisers (``tensorrt_precision``), and ModelOpt exports FP8 attention only from a 16-bit module with
    16-bit Q/DQ (export_onnx.py export_fp8_mha: "the qdqs must be in 16 bits"). With ``trt_high_precision_dtype`` of
    the input's type, ``export_int8`` writes its scales in that type and no Cast around the Q/DQ (export_onnx.py:
    "TRT StronglyType requires both weights and amax to be in the BF16/FP16, or the QDQ in Float"); FP8 scales
    follow the input's type. PyTorch runs fp16 on the CPU (slowly): the export traces the smallest input."""
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer

    dtype, name = {"fp16": (torch.float16, "Half"), "bf16": (torch.bfloat16, "BFloat16")}[precision]
    with quiet_loading():  # diffusers' note on casting with to() instead of from_pretrained: nothing to act on
        network.to(dtype)
    for module in network.modules():
        if isinstance(module, TensorQuantizer):
            module.trt_high_precision_dtype = name
