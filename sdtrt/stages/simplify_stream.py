"""The simplify stage's ``stream`` method: a cleanup for graphs whose weights are too big to load, which never
loads them.

``stream`` reads the graph without its external data, sets every weight aside as a typed graph input while
onnx-graphsurgeon removes Identity and dead nodes and folds small in-graph constants, runs shape inference on the
weight-free graph, then puts the weights back as they were: the input's ``.onnx.data`` becomes
``<component>.sim.onnx.data``, offsets unchanged, copied by the kernel (copy_file_range: no byte passes through
Python, holes stay holes, filesystems with shared extents share them); only when cleanup dropped some weights are
the kept ones copied tensor by tensor into a new file. Not hard-linked: onnx 1.23 refuses to load or check a graph
whose data file has more than one link ("potential hardlink attack", onnx/checker.cc), which would break the
export too. Its memory is the weight-free graph's, whatever the weights weigh; ``auto`` takes it for graphs over
64 MiB of weights (simplify.STREAM_ABOVE) or too big for the memory budget.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import SimplifyError
from ..graph import onnx_graph
from ..runtime.onnxruntime import quiet_default_logger

if TYPE_CHECKING:
    import onnx
    import onnx_graphsurgeon as gs

# Initializers up to this size held inside the graph are constants to fold (shape arithmetic); bigger or external ones
# are weights, never read by the stream method. onnx saves tensors this small inline too (size_threshold=1024).
SMALL_CONSTANT = 1024
COPY_CHUNK = 64 * 2**20
DATA_ALIGNMENT = 4096  # page-aligned offsets, so runtimes can memory-map each tensor


def stream(source: Path, out_path: Path) -> str:
    """Clean up ``source`` into ``out_path`` without reading its weights; returns how they were carried over.

    Weights (external, or over SMALL_CONSTANT bytes) leave the graph as typed inputs while onnx-graphsurgeon
    works, so folding can neither read nor fold them (their shapes still fold); the ones still consumed go back
    as they were.
    """
    import onnx
    import onnx_graphsurgeon as gs

    model = onnx_graph.load_graph(source)
    weights, listed = _set_weights_aside(model)
    graph = onnx_graph.import_for_surgery(onnx.shape_inference.infer_shapes(model))
    _bypass_identities(graph)
    quiet_default_logger()  # fold_constants evaluates on ONNX Runtime
    # In the exporter's order, not re-sorted: ONNX Runtime runs a graph in its nodes' order, and toposort's order
    # (every node as soon as its inputs are ready) made SD 1.5's fp16 UNet peak 4.7 GiB on ONNX Runtime, not 3.1.
    graph.fold_constants(size_threshold=SMALL_CONSTANT).cleanup()
    cleaned = gs.export_onnx(graph)
    dropped = _put_weights_back(cleaned, weights, listed)
    carried = _carry_weights(source.parent, out_path, cleaned, dropped)
    onnx.save_model(onnx.shape_inference.infer_shapes(cleaned), str(out_path))
    return carried


def _set_weights_aside(model: onnx.ModelProto) -> tuple[dict[str, onnx.TensorProto], set[str]]:
    """Move the weights out of ``model``'s initializers into typed graph inputs (in place).

    Returns them by name, and the names the graph already listed among its inputs (older IR versions list
    initializers there too), which stay listed.
    """
    from onnx import TensorProto, helper
    from onnx.external_data_helper import uses_external_data

    graph = model.graph
    listed = {v.name for v in graph.input}
    weights: dict[str, TensorProto] = {}
    constants = []
    for tensor in graph.initializer:
        kept = TensorProto()
        kept.CopyFrom(tensor)  # an external tensor is a stub: name, type, shape and where its bytes are
        if not uses_external_data(tensor) and onnx_graph.tensor_bytes(tensor) <= SMALL_CONSTANT:
            constants.append(kept)
            continue
        weights[tensor.name] = kept
        if tensor.name not in listed:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    del graph.initializer[:]
    graph.initializer.extend(constants)
    return weights, listed & set(weights)


def _bypass_identities(graph: gs.Graph) -> None:
    """Identity nodes go: their consumers read the Identity's input (one naming a graph output stays)."""
    for node in graph.nodes:
        if node.op != "Identity" or node.outputs[0] in graph.outputs:
            continue
        source, target = node.inputs[0], node.outputs[0]
        for consumer in list(target.outputs):
            for slot, tensor in enumerate(consumer.inputs):
                if tensor is target:
                    consumer.inputs[slot] = source
        node.outputs.clear()  # cleanup removes the node


def _put_weights_back(model: onnx.ModelProto, weights: dict[str, onnx.TensorProto], listed: set[str]) -> list[str]:
    """Return the set-aside weights the cleaned graph still reads to its initializers; returns the dropped ones."""
    graph = model.graph
    used = _consumed(graph) | {v.name for v in graph.output}
    inputs = [v for v in graph.input if v.name not in weights or (v.name in listed and v.name in used)]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(tensor for name, tensor in weights.items() if name in used)
    return [name for name in weights if name not in used]


def _consumed(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node reads, in subgraphs (If, Loop, Scan bodies) too."""
    from onnx import AttributeProto

    names: set[str] = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                names |= _consumed(attribute.g)
            elif attribute.type == AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    names |= _consumed(subgraph)
    return names


def _carry_weights(source_dir: Path, out_path: Path, model: onnx.ModelProto, dropped: list[str]) -> str:
    """Point ``model``'s external data at ``<out_path>.data``; returns how the bytes got there.

    One source file and nothing dropped: that file, copied whole by the kernel, offsets unchanged. Otherwise each
    kept tensor's bytes are copied to a new, page-aligned offset of a new file, so no dropped weight stays on disk.
    """
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        return "none: the graph holds its weights" + (f" (cleanup dropped {len(dropped)})" if dropped else "")
    target = onnx_graph.data_file(out_path)
    files = {ExternalDataInfo(t).location for t in external}
    if len(files) == 1 and not dropped:
        source = source_dir / files.pop()
        with source.open("rb") as src, target.open("wb") as dst:
            size = os.fstat(src.fileno()).st_size
            for start, end in _data_extents(src.fileno(), size):
                _copy_range(src.fileno(), dst.fileno(), start, start, end - start)
            dst.truncate(size)
        for tensor in external:
            _set_external(tensor, location=target.name)
        return f"copied {source.name} to {target.name} in the kernel, offsets unchanged ({len(external)} initializers)"
    with target.open("wb") as dst:
        for tensor in external:
            info = ExternalDataInfo(tensor)
            length = info.length if info.length is not None else onnx_graph.tensor_bytes(tensor)
            offset = -(-dst.seek(0, os.SEEK_END) // DATA_ALIGNMENT) * DATA_ALIGNMENT
            with (source_dir / info.location).open("rb") as src:
                if os.fstat(src.fileno()).st_size < (info.offset or 0) + length:
                    raise SimplifyError(f"{info.location} ends inside initializer {tensor.name}; re-export the graph")
                _copy_range(src.fileno(), dst.fileno(), info.offset or 0, offset, length)
            _set_external(tensor, location=target.name, offset=offset, length=length)
    why = f"cleanup dropped {len(dropped)} unused initializers" if dropped else f"they were in {len(files)} files"
    return f"rewrote {target.name} by streaming {len(external)} initializers into it: {why}"


def _data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """The [start, end) ranges of a file that hold data (SEEK_DATA/SEEK_HOLE); holes read as zeros, take no disk."""
    extents, offset = [], 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # ENXIO: nothing but a hole from here on
            break
        offset = os.lseek(fd, start, os.SEEK_HOLE)
        extents.append((start, offset))
    return extents


def _copy_range(src: int, dst: int, src_offset: int, dst_offset: int, length: int) -> None:
    """Copy bytes between files in the kernel (copy_file_range; a filesystem with shared extents shares them),
    else through one COPY_CHUNK buffer at a time: never a whole tensor, let alone a whole file, in memory."""
    while length > 0:
        try:
            copied = os.copy_file_range(src, dst, min(length, 2**30), src_offset, dst_offset)
        except OSError:  # a kernel or filesystem without it (EXDEV, ENOSYS, EOPNOTSUPP)
            copied = os.pwrite(dst, os.pread(src, min(length, COPY_CHUNK), src_offset), dst_offset)
        if copied <= 0:
            raise SimplifyError(f"copying weights stopped {length} bytes short; is the disk full?")
        src_offset, dst_offset, length = src_offset + copied, dst_offset + copied, length - copied


def _set_external(tensor: onnx.TensorProto, **entries: str | int) -> None:
    """Set external-data entries (location, offset, length) of a tensor whose bytes are not loaded.

    onnx's set_external_data needs the bytes (raw_data) at hand, which is what the stream method never has.
    """
    current = {entry.key: entry for entry in tensor.external_data}
    for key, value in entries.items():
        if key in current:
            current[key].value = str(value)
        else:
            tensor.external_data.add(key=key, value=str(value))
