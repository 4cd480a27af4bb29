"""``check_graph``: the graph's IO as its spec says, its output shapes from shape inference on the weight-free
graph, and its initializers accounted for against the model's parameters as the safetensors headers list them
(nothing loaded)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...graph import onnx_graph
from ...graph.onnx_scopes import WRAPPER
from ...spec import FOLDERS, GraphSpec
from .shapes import check_size, concrete_shapes, inputs_label
from .stored import StoredTensor, stored_tensors

if TYPE_CHECKING:
    import onnx

    from ...sources.models import ModelSource

# The exporter's optimizer merges identical initializers up to this many elements (onnx_ir
# passes/common/initializer_deduplication.py, DeduplicateInitializersPass(size_limit=1024)): freshly
# initialised norm weights (all ones) then share one initializer; larger ones never do.
DEDUP_MAX_ELEMENTS = 1024


@dataclass
class GraphCheck:
    io: list[str] = field(default_factory=list)  # problems with the graph's IO
    output_shapes: dict[str, Any] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def initializer_nbytes(init: onnx.TensorProto) -> int:
    import onnx

    itemsize = onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return int(np.prod(init.dims, dtype=np.int64)) * itemsize


def graph_dtype_of(init: onnx.TensorProto) -> str:
    import onnx

    return str(onnx.helper.tensor_dtype_to_np_dtype(init.data_type).name)


def fp32_modules(model: ModelSource, folder: str) -> tuple[str, ...]:
    """Modules the network's class keeps in fp32 whatever the dtype it is loaded in (transformers' T5 ``wo``)."""
    import importlib

    library, class_name = model.component_class(folder)
    cls = getattr(importlib.import_module(library), class_name, None)
    return tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())


def account_parameters(
    graph: onnx.GraphProto, params: dict[str, StoredTensor], dtype: str, keep_fp32: Sequence[str] = ()
) -> dict[str, Any]:
    """Find every stored tensor among the graph's initializers, by name or (renamed, transposed by the exporter's
    constant folding) by shape, in the dtype the graph should hold it in.

    Parameters a small merged initializer stands for are counted apart; what is left over are the exporter's
    own constants. Failures: a parameter found nowhere, or held in another dtype or shape.
    """
    inits = {i.name: i for i in graph.initializer}
    failures, matched, pending = [], {}, []

    def wanted(name: str, stored: StoredTensor) -> str:
        if not stored.dtype.startswith(("float", "bfloat")):
            return stored.dtype
        kept = any(re.search(rf"(^|\.){re.escape(m)}(\.|$)", name) for m in keep_fp32)
        return "float32" if kept else dtype

    for name, stored in params.items():
        init = inits.get(WRAPPER + name)
        if init is None:
            pending.append(name)
            continue
        got = (graph_dtype_of(init), tuple(init.dims))
        if got != (wanted(name, stored), stored.shape):
            failures.append(f"initializer {init.name} is {got[0]} {list(got[1])}, expected "
                            f"{wanted(name, stored)} {list(stored.shape)}")  # fmt: skip
        matched[name] = init.name
    anonymous: dict[tuple[str, tuple[int, ...]], list[str]] = defaultdict(list)
    for init in graph.initializer:
        if init.name.removeprefix(WRAPPER) not in params:
            anonymous[(graph_dtype_of(init), tuple(init.dims))].append(init.name)
    merged = []
    for name in sorted(pending, key=lambda n: -params[n].numel):
        stored = params[name]
        shapes = folded_shapes(stored.shape)
        pool = next((anonymous[(wanted(name, stored), s)] for s in shapes if anonymous[(wanted(name, stored), s)]), [])
        if pool:
            matched[name] = pool.pop()
        elif stored.numel <= DEDUP_MAX_ELEMENTS and any(tuple(i.dims) in shapes for i in graph.initializer):
            merged.append(name)
        else:
            failures.append(f"parameter {name} {list(stored.shape)} is in no initializer of the graph")
    expected_bytes = sum(params[n].numel * np.dtype(_np_name(wanted(n, params[n]))).itemsize for n in matched)
    held = {inits[i].name: initializer_nbytes(inits[i]) for i in matched.values()}
    constants = [i for names in anonymous.values() for i in names]
    return {
        "parameters": len(params),
        "initializers": len(set(matched.values())),
        "merged_small": len(merged),
        "bytes_expected": expected_bytes,
        "bytes_in_graph": sum(held.values()),
        "constants": len(constants),
        "constant_bytes": sum(initializer_nbytes(inits[c]) for c in constants),
        "failures": failures,
    }


def folded_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes the exporter's constant folding gives a parameter, most likely first: a Linear's weight transposed,
    a table gathered whole at indices that never change (CLIP's position embedding at its position_ids buffer: a
    (1, positions, width) constant), a GroupNorm's per-channel weight and bias reshaped to broadcast over height and
    width ((C,) → (C, 1, 1): the exporter writes GroupNorm as InstanceNormalization, then Mul and Add)."""
    if len(shape) == 2:
        return [shape[::-1], shape, (1, *shape)]
    if len(shape) == 1:
        return [shape, (*shape, 1, 1)]
    return [shape]


def _np_name(dtype: str) -> str:
    """numpy has no bfloat16; its itemsize is float16's."""
    return "float16" if dtype == "bfloat16" else dtype


def check_graph(
    graph_path: Path, spec: GraphSpec, model: ModelSource, params: dict[str, StoredTensor] | None = None
) -> GraphCheck:
    """IO, output shapes inferred at two sizes, parameters: from the weight-free graph and the safetensors headers
    (``params``: the model's stored tensors by loaded name, default: as stored)."""
    proto = onnx_graph.load_graph(graph_path)
    result = GraphCheck()
    inputs, outputs = onnx_graph.graph_io(graph_path)
    for kind, got, want in (("input", inputs, spec.inputs()), ("output", outputs, spec.outputs())):
        if [t.name for t in got] != [t.name for t in want]:
            result.io.append(f"graph {kind}s are {[t.name for t in got]}, the spec says {[t.name for t in want]}")
            continue
        result.io += [
            f"{kind} {g.name} is {g.dtype} {list(g.shape)}, the spec says {w.dtype} {list(w.shape)}"
            for g, w in zip(got, want, strict=True)
            if (g.dtype, tuple(g.shape)) != (w.dtype, tuple(w.shape))
        ]
    result.failures += result.io
    batch, height, width, tokens = check_size(spec)
    for size in ((batch, height, width, tokens), (batch + 1, width, height, tokens + 4)):
        shapes = spec.input_shapes(*size)
        inferred = concrete_shapes(proto, shapes)
        for name, shape in spec.output_shapes(shapes).items():
            inferred_shape = inferred.get(name, (0, ()))[1]
            result.output_shapes[f"{name} at {inputs_label(spec, *size)}"] = list(inferred_shape)
            if tuple(inferred_shape) != tuple(shape):
                result.failures.append(
                    f"output {name} infers to {list(inferred_shape)} for inputs {shapes}, expected {list(shape)}"
                )
    folder = FOLDERS[spec.component]
    params = params if params is not None else stored_tensors(model.component_dir(folder))
    unread = spec.unread_parameters(model.component_config(folder), params.keys())
    params = {name: t for name, t in params.items() if name not in unread}
    result.parameters = account_parameters(proto.graph, params, spec.dtype, fp32_modules(model, folder))
    result.failures += result.parameters["failures"]
    return result
