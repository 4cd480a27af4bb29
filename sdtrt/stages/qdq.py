"""Q/DQ ONNX graph rewrites: ModelOpt's FP8 zero points retyped, its ``trt::`` FP8 ops made standard ONNX Q/DQ, and
a graph's quantize/dequantize nodes counted by type."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from ..graph import onnx_graph

if TYPE_CHECKING:
    import onnx

FP8_ZERO_POINT = "sdtrt_fp8_zero_point"
FP8_ZERO_POINT = "sdtrt_fp8_zero_point"


def _cleaned(proto: onnx.ModelProto) -> onnx.ModelProto:
    import onnx_graphsurgeon as gs

    graph = onnx_graph.import_for_surgery(proto)
    graph.cleanup().toposort()
    return gs.export_onnx(graph)


def convert_zp_fp8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """ModelOpt's example's ``convert_zp_fp8``: the zero points of QuantizeLinear (and their DequantizeLinear)
    retyped from INT8 to FLOAT8E4M3FN; a zero is a zero in both, so only the type changes."""
    import onnx

    zero_points = {n.input[2] for n in proto.graph.node if n.op_type in _QDQ and len(n.input) > 2}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] in zero_points:
            node.attribute[0].t.data_type = onnx.TensorProto.FLOAT8E4M3FN
    for initializer in proto.graph.initializer:
        if initializer.name in zero_points:
            initializer.data_type = onnx.TensorProto.FLOAT8E4M3FN
    return proto


_QDQ = ("QuantizeLinear", "DequantizeLinear")
_TRT_FP8 = {"TRT_FP8QuantizeLinear": "QuantizeLinear", "TRT_FP8DequantizeLinear": "DequantizeLinear"}


def standard_fp8_qdq(proto: onnx.ModelProto) -> int:
    """Rewrite ModelOpt's ``trt::TRT_FP8QuantizeLinear``/``TRT_FP8DequantizeLinear`` to standard ONNX Q/DQ with a
    float8e4m3fn zero point (``saturate=1``, as TensorRT saturates), in place; returns how many were rewritten."""
    import onnx

    rewritten = set()
    for node in proto.graph.node:
        if node.domain == "trt" and node.op_type in _TRT_FP8:
            node.domain = ""
            node.op_type = _TRT_FP8[node.op_type]
            node.input.append(FP8_ZERO_POINT)
            if node.op_type == "QuantizeLinear":
                node.attribute.append(onnx.helper.make_attribute("saturate", 1))
            rewritten.update(node.output)
    if rewritten:
        zero = onnx.helper.make_tensor(FP8_ZERO_POINT, onnx.TensorProto.FLOAT8E4M3FN, [], [0])
        proto.graph.initializer.append(zero)
        # The exporter typed the trt:: quantize outputs uint8; shape inference retypes them from the zero point.
        kept = [v for v in proto.graph.value_info if v.name not in rewritten]
        del proto.graph.value_info[:]
        proto.graph.value_info.extend(kept)
    if not any(node.domain == "trt" for node in proto.graph.node):
        imports = [o for o in proto.opset_import if o.domain != "trt"]
        del proto.opset_import[:]
        proto.opset_import.extend(imports)
    return len(rewritten)


def qdq_counts(path: Path) -> dict[str, int]:
    """``op:TYPE`` → count of a graph's quantize/dequantize nodes, TYPE the zero point's (``INT8``,
    ``FLOAT8E4M3FN``); ModelOpt's ``trt::`` FP8 ops count as ``trt::op:FLOAT8E4M3FN``."""
    import onnx

    graph = onnx_graph.load_graph(path).graph
    types = {i.name: i.data_type for i in graph.initializer}
    types |= {n.output[0]: n.attribute[0].t.data_type for n in graph.node if n.op_type == "Constant" and n.attribute}
    counts: Counter[str] = Counter()
    for node in graph.node:
        if node.op_type in _QDQ and node.domain == "":
            zero_point = types.get(node.input[2]) if len(node.input) > 2 else None
            counts[f"{node.op_type}:{onnx.TensorProto.DataType.Name(zero_point) if zero_point else 'UINT8'}"] += 1
        elif node.domain == "trt" and node.op_type in _TRT_FP8:
            counts[f"trt::{node.op_type}:FLOAT8E4M3FN"] += 1
    return dict(sorted(counts.items()))
