"""The check size (small seeded inputs, every axis distinct) and the concrete shapes inferred at it on the
weight-free graph."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ...core.config import pixel_size
from ...core.errors import ArtifactError, one_line

if TYPE_CHECKING:
    import onnx

    from ...spec import GraphSpec


def check_size(spec: GraphSpec) -> tuple[int, int, int, int]:
    """Batch, height and width in pixels, text tokens of the seeded block inputs: small, every axis distinct, so
    tensors are told apart by their shapes (patches 4×6 = 24 latent tokens, 10 text tokens)."""
    return 1, 4 * spec.pixel_multiple, 6 * spec.pixel_multiple, 10


def inputs_label(spec: GraphSpec, batch: int, height: int, width: int, tokens: int) -> str:
    """The check size in words: "batch 1, 48×32 px (w×h)" (no size for a text encoder; ", 10 text tokens" for graphs
    with a token axis: T5's, or an LLM encoder's as Z-Image's and Qwen-Image's)."""
    size = f", {pixel_size(height, width)}" if spec.reads_pixels else ""
    text = f", {tokens} text tokens" if spec.default_profile().tokens is not None else ""
    return f"batch {batch}{size}{text}"


def concrete_shapes(proto: onnx.ModelProto, input_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Every value's (elem type, shape) with the graph's inputs fixed to ``input_shapes``, by ONNX Runtime's symbolic
    shape inference on the weight-free graph. onnx's own ``infer_shapes`` loses dims at Reshapes fed by Shape
    arithmetic, and ORT's fails on Split with symbolic sizes: concrete sizes it resolves throughout."""
    import onnx
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    fixed = copy.deepcopy(proto)
    for value in fixed.graph.input:
        if value.name in input_shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, input_shapes[value.name], strict=True):
                dim.ClearField("dim_param")
                dim.dim_value = size
    for value in fixed.graph.output:
        value.type.tensor_type.ClearField("shape")
    del fixed.graph.value_info[:]
    # Weights become typed inputs: the inference then reads none of them (it would look for the external data
    # relative to the working directory where it evaluates one, as SD3's positional embedding, a sliced buffer).
    external = [i for i in fixed.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    fixed.graph.input.extend(onnx.helper.make_tensor_value_info(i.name, i.data_type, i.dims) for i in external)
    kept = [i for i in fixed.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
    del fixed.graph.initializer[:]
    fixed.graph.initializer.extend(kept)
    try:
        inferred = SymbolicShapeInference.infer_shapes(fixed)
    except Exception as exc:  # it raises whatever its per-op code hits (TypeError, KeyError, …)
        raise ArtifactError(f"shape inference failed on the weight-free graph: {one_line(exc)}") from exc
    graph = inferred.graph
    out: dict[str, Any] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        out[value.name] = (
            tensor.elem_type,
            tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim),
        )
    for init in graph.initializer:
        out[init.name] = (init.data_type, tuple(init.dims))
    return out
