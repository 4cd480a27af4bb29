"""Initializers streamed from a model folder's safetensors files into ONNX external data, one tensor at a time.

The weight-free export (stages/export_stream.py) traces a network whose parameters hold no data; this module gives
each initializer of the traced graph its values back without ever holding more than one tensor: a source
weight is read through a memory map of its safetensors file and cast to the graph's dtype when something
asks for its bytes (the exporter's constant folding, or the writer), and the writer appends initializers to
``<graph>.onnx.data`` one by one, as ``onnx.save_model`` lays them out. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..core.errors import ExportError

# safetensors' dtype codes (its format spec) as numpy dtype names; bfloat16 is ml_dtypes', which onnx_ir uses.
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
# onnx.save_model(size_threshold=1024) keeps a tensor inline while sys.getsizeof(raw_data) is under it
# (onnx/external_data_helper.py convert_model_to_external_data): the bytes object's header counts.
INLINE_BELOW = 1024


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def numpy_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# The weight files from_pretrained reads without a variant: sharded (an index) or whole, diffusers' and transformers'.
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files ``from_pretrained`` reads from the folder without a variant: the shards its index
    names, else the one file; never a variant's (``name.fp16.safetensors``, ``name.fp16-00001-of-00002…``)."""
    for name in WEIGHT_FILES:
        if (index := folder / f"{name}.index.json").is_file():
            return sorted({folder / file for file in json.loads(index.read_text())["weight_map"].values()})
        if (single := folder / name).is_file():
            return [single]
    return []


def safetensors_index(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's weight files (weight_files: one file or its shards), by name.

    Reads the headers only: an 8-byte little-endian length, then JSON naming each tensor's dtype, shape and
    data offsets (relative to the end of the header), as the safetensors format defines them.
    """
    index: dict[str, StoredTensor] = {}
    for file in weight_files(folder):
        index |= safetensors_file_index(file)
    return index


def safetensors_file_index(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, by name, from its header alone."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    index = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ExportError(f"{file}: tensor '{name}' has dtype {entry['dtype']}, which sdtrt cannot stream")
        begin, end = entry["data_offsets"]
        index[name] = StoredTensor(
            file, SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin, 8 + length + end
        )
    return index


def read_tensor(stored: StoredTensor, dtype: np.dtype[Any]) -> np.ndarray:
    """One stored tensor in ``dtype``, read through a memory map; the only copy is the returned array."""
    mapped = np.memmap(stored.file, dtype=numpy_dtype(stored.dtype), mode="r", offset=stored.start, shape=stored.shape)
    try:
        # Rounds to nearest even, as torch's Tensor.to does when from_pretrained(dtype=…) casts a weight.
        return np.array(mapped, dtype=dtype, copy=True)
    finally:
        del mapped


def weights_size(folder: Path) -> int:
    """Bytes of the folder's weight files (weight_files)."""
    return sum(f.stat().st_size for f in weight_files(folder))


def check_sources(names: Iterable[str], stored: Mapping[str, StoredTensor], folder: Path) -> None:
    """Raise ExportError, naming them, if the safetensors files lack any of the network's state-dict ``names``."""
    missing = [name for name in names if name not in stored]
    if missing:
        _refuse(missing, [], folder)


def _refuse(missing: list[str], mismatched: list[str], folder: Path | str) -> None:
    shown = ", ".join((missing + mismatched)[:5]) + (" …" if len(missing) + len(mismatched) > 5 else "")
    raise ExportError(
        f"the safetensors files in {folder} lack {len(missing)} weight(s) the network needs and hold {len(mismatched)} "
        f"of another shape ({shown}): they do not match its config.json; re-save the model (save_pretrained), "
        "or export with --weights load to see what loading it says"
    )


def attach_weights(
    model: Any, sources: Mapping[str, StoredTensor], computed: Mapping[str, np.ndarray], prefix: str = ""
) -> None:
    """Give every initializer of a weight-free ``onnx_ir`` model its values, lazily.

    An initializer named ``prefix + key`` reads safetensors tensor ``key`` on demand, cast to its graph dtype;
    one named in ``computed`` (non-persistent buffers and constants, small) takes that array. Raise ExportError
    naming what is missing, or a shape that differs, before anything is read.
    """
    import onnx_ir as ir

    missing, mismatched = [], []
    for name, value in model.graph.initializers.items():
        if name in computed:
            value.const_value = ir.tensor(np.asarray(computed[name], dtype=value.dtype.numpy()), name=name)
            continue
        stored = sources.get(name.removeprefix(prefix)) if name.startswith(prefix) else None
        if stored is None:
            missing.append(name.removeprefix(prefix))
            continue
        shape = tuple(value.shape.numpy()) if value.shape is not None else ()
        if shape != stored.shape:
            mismatched.append(f"{name.removeprefix(prefix)} {list(stored.shape)} (graph: {list(shape)})")
            continue
        value.const_value = ir.LazyTensor(
            _reader(stored, value.dtype.numpy()), dtype=value.dtype, shape=ir.Shape(shape), name=name
        )
    if missing or mismatched:
        _refuse(missing, mismatched, "the model folder")


def _reader(stored: StoredTensor, dtype: np.dtype[Any]) -> Callable[[], Any]:
    import onnx_ir as ir

    return lambda: ir.tensor(read_tensor(stored, dtype))


@contextlib.contextmanager
def folded_constants_on_disk(scratch: Path) -> Iterator[None]:
    """While the exporter's optimizer folds constants, no folded weight piles up in memory.

    The optimizer folds the Transpose of every Linear weight into a new initializer, so its results are as big as
    the network's matrices (23 GB for Flux's transformer), and were all held until the graph was written. A
    Transpose of a streamed weight (attach_weights') that nothing else reads folds into a transposed weight computed
    when the writer asks for its bytes (_fold_transpose_when_written): read once, at writing, and never spilled.
    Any other large fold goes to ``scratch`` as it is made and stays there as a reference. Folded values keep their
    names, order and bytes; only where they live changes. The hooks are onnxscript's
    ``FoldConstantsPass.new_initializer`` and its registry of partial evaluators
    (onnxscript/optimizer/_constant_folding.py), which torch 2.13's exporter runs through
    ``onnxscript.optimizer.optimize_ir``: private names, checked by the streamed-export test.
    """
    from onnxscript.optimizer import _constant_folding as folding

    original = folding.FoldConstantsPass.new_initializer
    evaluators = folding.registry.op_evaluators.setdefault(("", "Transpose"), [])
    lazy = folding.PartialEvaluator(None, None, _fold_transpose_when_written)
    with scratch.open("wb") as spill:

        def new_initializer(self: Any, node: Any, array: Any) -> Any:
            value = original(self, node, array)
            if value is not None and value.const_value is not None:
                _append_if_large(value, spill, scratch)
            return value

        folding.FoldConstantsPass.new_initializer = new_initializer  # type: ignore[method-assign]
        evaluators.append(lazy)
        try:
            yield
        finally:
            folding.FoldConstantsPass.new_initializer = original  # type: ignore[method-assign]
            evaluators.remove(lazy)


def _fold_transpose_when_written(node: Any, context: Any, state: Any) -> Any:
    """A partial evaluator for onnxscript's constant folding: ``Transpose(W)``, W a streamed weight of the graph read
    by this node alone, becomes the initializer onnxscript would make of it (the node's output name, W's dtype, the
    permuted shape, registered in the graph where onnxscript registers its folds), its bytes W's transposed, computed
    when written. onnxscript folds every such Transpose whatever its size (``_DEFAULT_ALWAYS_FOLD_OPS``: its input has
    one consumer), reading W and holding the result; None for anything else, which onnxscript then folds or keeps
    as it would."""
    import onnx_ir as ir
    from onnxscript.optimizer._constant_folding import Replacement

    source = node.inputs[0] if len(node.inputs) == 1 else None
    graph = node.graph
    weight = source.const_value if source is not None else None
    if (
        source is None
        or not isinstance(weight, ir.LazyTensor)
        or not isinstance(graph, ir.Graph)
        or source.is_graph_input()
        or source.is_graph_output()
        or len(source.consumers()) != 1
        or graph.initializers.get(source.name) is not source
    ):
        return None
    rank = len(weight.shape)
    perm_attr = node.attributes.get("perm")
    perm = tuple(perm_attr.value) if perm_attr is not None else tuple(reversed(range(rank)))
    if sorted(perm) != list(range(rank)):
        return None  # not a permutation of W's axes: onnxscript's evaluation fails, and it keeps the node
    shape = ir.Shape([weight.shape[axis] for axis in perm])
    name = node.outputs[0].name

    def transposed() -> Any:
        return ir.tensor(np.ascontiguousarray(np.transpose(weight.numpy(), perm)), name=name)

    tensor = ir.LazyTensor(transposed, dtype=weight.dtype, shape=shape, name=name)
    value = ir.Value(name=name, type=ir.TensorType(weight.dtype), shape=shape, const_value=tensor)
    graph.register_initializer(value)
    return Replacement([value], [])


def save_streamed(model: Any, path: Path, external: bool, scratch: Path | None = None) -> None:
    """Save an ``onnx_ir`` model as ``path`` (+ ``path.data`` when ``external``), one initializer in memory at a time.

    External data is laid out as ``onnx.save_model(..., all_tensors_to_one_file=True, size_threshold=1024)``
    lays it out: initializers in graph order, appended without padding, the small ones kept inline.
    Every written initializer is replaced by a reference to its bytes, so nothing accumulates. The bytes of a
    tensor read from ``scratch`` (folded_constants_on_disk's file) are released there once copied, so the disk holds
    the weights about once, not twice (23 GB, not 47 GB, for Flux's transformer).
    """
    import onnx_ir as ir

    if external:
        data = path.with_name(path.name + ".data")
        with data.open("wb") as f, _hole_puncher(scratch) as release:
            for value in model.graph.initializers.values():
                source = value.const_value
                if _append_if_large(value, f, data):  # a small one stays inline, read again when serialized
                    release(source)
    else:  # a graph under protobuf's limit holds its weights: the folds spilled to ``scratch`` come back inline
        for value in model.graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                value.const_value = ir.tensor(np.array(value.const_value.numpy()), name=value.name)
    ir.save(model, path)


@contextlib.contextmanager
def _hole_puncher(scratch: Path | None) -> Iterator[Callable[[Any], None]]:
    """A function that frees the disk blocks of an ``ir.ExternalTensor`` stored in ``scratch`` (others are left
    alone: a model's own safetensors files are never touched). Linux fallocate(2) with FALLOC_FL_PUNCH_HOLE |
    FALLOC_FL_KEEP_SIZE: offsets stay valid, the range reads as zeros. Where the file system cannot punch holes
    nothing is freed, and the scratch file is deleted whole afterwards as before."""
    if scratch is None or not scratch.exists():
        yield lambda tensor: None
        return
    import ctypes
    import os

    fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    fd, scratch = os.open(scratch, os.O_WRONLY), scratch.resolve()
    punch_hole_keep_size = 0x02 | 0x01  # linux/falloc.h

    def release(tensor: Any) -> None:
        path = getattr(tensor, "path", None)
        if fallocate is not None and path is not None and Path(path).resolve() == scratch:
            fallocate(fd, punch_hole_keep_size, ctypes.c_int64(tensor.offset), ctypes.c_int64(tensor.length))

    try:
        yield release
    finally:
        os.close(fd)


def _append_if_large(value: Any, f: BinaryIO, file: Path) -> bool:
    """Append an initializer's bytes to ``f`` (open on ``file``) and point the value at them, unless onnx would keep
    it inline (INLINE_BELOW): its data then lives in the file, not in memory. Whether it was appended."""
    import onnx_ir as ir

    tensor = value.const_value
    if sys.getsizeof(b"") + tensor.nbytes < INLINE_BELOW:
        return False
    offset = f.tell()
    f.write(tensor.tobytes())
    f.flush()  # the reference may be read (memory-mapped) before the file is closed: the optimizer reads its spills
    value.const_value = ir.ExternalTensor(
        file.name, offset, tensor.nbytes, tensor.dtype, shape=ir.Shape(tensor.shape.numpy()), name=str(value.name),
        base_dir=file.parent,
    )  # fmt: skip
    return True
