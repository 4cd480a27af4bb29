"""Cutting a block out of the graph: its nodes (by module scope) and what they read from elsewhere, written as a
graph of their own with only that block's initializers, streamed by their external-data offsets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.errors import ArtifactError
from ...graph import onnx_graph
from ...graph.onnx_scopes import WRAPPER
from .graph_check import DEDUP_MAX_ELEMENTS, initializer_nbytes
from .scopes import NO_SCOPES, node_scopes

if TYPE_CHECKING:
    import onnx

COPY_CHUNK = 16 << 20


@dataclass
class Cut:
    """A block's subgraph: its file, and its boundary as (name, elem type, shape)."""

    path: Path
    data_inputs: list[tuple[str, int, tuple[int, ...]]]  # values the block computes with
    shape_inputs: list[tuple[str, int, tuple[int, ...]]]  # values only their shape is read of (fed zeros)
    outputs: list[tuple[str, int, tuple[int, ...]]]
    nodes: int
    weight_bytes: int


def is_float(elem_type: int) -> bool:
    import onnx

    return elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.DOUBLE)  # fmt: skip


def block_nodes(graph: onnx.GraphProto, block: str, is_data: Callable[[str], bool]) -> set[int]:
    """Indices of the nodes inside the module ``block`` (a path in the network, e.g. transformer_blocks.0).

    The exporter's optimizer writes some nodes without scopes (the Splits it makes of chunked Slices): those whose
    data inputs (``is_data``: float values) the block's nodes make are the block's too. Their size inputs may come
    from anywhere: the optimizer computes equal sizes once and shares them, so every later Flux double-stream block
    splits its attention output by sizes made in transformer_blocks.0."""
    scope = WRAPPER + block
    scoped = [node_scopes(node) for node in graph.node]
    members = {i for i, scopes in enumerate(scoped) if scope in scopes}
    if not members:
        if not any(scoped):
            raise ArtifactError(NO_SCOPES)
        raise ArtifactError(f"no node of the graph belongs to module {block}; name a block of the network")
    inits = {i.name for i in graph.initializer}
    made = {out for i in members for out in graph.node[i].output}
    for i, node in enumerate(graph.node):  # in topological order: a chain of such nodes joins in one pass
        inputs = [n for n in node.input if n and n not in inits and is_data(n)]
        if not scoped[i] and inputs and all(n in made for n in inputs):
            members.add(i)
            made.update(node.output)
    return members


def cut_block(
    proto: onnx.ModelProto, graph_dir: Path, block: str, shapes: dict[str, Any], out_path: Path,
    is_argument: Callable[[str], bool],
) -> Cut:  # fmt: skip
    """Write ``block``'s nodes as a graph of their own, its initializers streamed into ``out_path``.data.

    Inputs are what the block reads and does not make, initializers aside. Some of what it reads the exporter
    computes elsewhere, and those producers are pulled into the cut: integer values (sizes computed once, before
    every block, back to the graph inputs they measure), constants, and float values that are no argument of the
    block (``is_argument``) but a weight-free function of one (``silu(temb)``, computed once and shared by every
    block). An argument (a float one, or a boolean key mask) stays an input. Outputs are the float values the
    block makes and something outside it reads.
    """
    import onnx

    graph = proto.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    inits = {i.name: i for i in graph.initializer}
    members = block_nodes(graph, block, lambda name: is_float(shapes[name][0]))
    own = set(members)

    def pulled_in(name: str) -> bool:
        node = graph.node[producer[name]]
        if is_argument(name):  # a float argument, or a mask one (Z-Image's joint key mask, made before the blocks)
            return False
        if not is_float(shapes[name][0]) or not node.input:
            return True
        if {graph.node[i].op_type for i in members if name in graph.node[i].input} == {"Shape"}:
            return False
        heavy = [i for i in node.input if i in inits and np.prod(inits[i].dims) > DEDUP_MAX_ELEMENTS]
        if heavy:
            raise ArtifactError(f"{block} reads {name}, which is no argument of the block but made with weights "
                                f"({heavy[0]}); the block cannot be cut alone")  # fmt: skip
        return True

    while True:
        made = {out for i in members for out in graph.node[i].output}
        outside = {n for i in members for n in graph.node[i].input if n and n not in made and n not in inits}
        pulled = {producer[n] for n in outside if n in producer and pulled_in(n)}
        if pulled <= members:
            break
        members |= pulled
    order = sorted(members)
    read = [name for i in order for name in graph.node[i].input if name]
    boundary = list(dict.fromkeys(n for n in read if n not in made and n not in inits))
    readers: dict[str, set[str]] = defaultdict(set)
    for i in order:
        for name in graph.node[i].input:
            readers[name].add(graph.node[i].op_type)
    read_outside = {name for i, node in enumerate(graph.node) if i not in members for name in node.input}
    read_outside |= {o.name for o in graph.output}
    outputs = [o for i in sorted(own) for o in graph.node[i].output if o in read_outside and is_float(shapes[o][0])]

    def value(name: str) -> tuple[str, int, tuple[int, ...]]:
        elem, dims = shapes[name]
        if any(d < 0 for d in dims):
            raise ArtifactError(f"shape inference left {name} of {block} without a size; the block cannot be cut")
        return name, elem, dims

    shape_only = [value(n) for n in boundary if readers[n] == {"Shape"}]
    data = [value(n) for n in boundary if readers[n] != {"Shape"}]
    used = sorted({n for n in read if n in inits})
    weights, weight_bytes = copy_initializers([inits[n] for n in used], graph_dir, out_path)
    sub = onnx.helper.make_graph(
        [graph.node[i] for i in order], block,
        [onnx.helper.make_tensor_value_info(n, e, d) for n, e, d in data + shape_only],
        [onnx.helper.make_tensor_value_info(*value(o)) for o in outputs], weights,
    )  # fmt: skip
    model = onnx.helper.make_model(sub, opset_imports=proto.opset_import, ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    onnx.save_model(model, str(out_path))
    return Cut(out_path, data, shape_only, [value(o) for o in outputs], len(own), weight_bytes)


def copy_initializers(
    inits: list[onnx.TensorProto], graph_dir: Path, out_path: Path
) -> tuple[list[onnx.TensorProto], int]:
    """Copy initializers for the graph at ``out_path``: embedded ones as they are, external ones streamed in chunks
    from their file and offset into ``out_path``.data, with new offsets. Returns them and their bytes."""
    import onnx

    copied, total = [], 0
    data_path = onnx_graph.data_file(out_path)
    with data_path.open("wb") as dst:
        for init in inits:
            new = onnx.TensorProto()
            new.CopyFrom(init)
            if init.data_location == onnx.TensorProto.EXTERNAL:
                entry = {e.key: e.value for e in init.external_data}
                offset, length = int(entry.get("offset", 0)), int(entry.get("length", initializer_nbytes(init)))
                start = dst.tell()
                with (graph_dir / entry["location"]).open("rb") as src:
                    src.seek(offset)
                    for remaining in _chunks(length):
                        dst.write(src.read(remaining))
                del new.external_data[:]
                for key, val in (("location", data_path.name), ("offset", str(start)), ("length", str(length))):
                    new.external_data.add(key=key, value=val)
                total += length
            else:
                total += initializer_nbytes(init)
            copied.append(new)
    return copied, total


def _chunks(length: int) -> Iterator[int]:
    while length > 0:
        yield min(COPY_CHUNK, length)
        length -= COPY_CHUNK
