"""Parity at a scale that does not fit: an exported graph checked by parts, never with all its weights loaded.

``check_graph``: the graph's IO as its spec says, its output shapes from shape inference on the weight-free
graph, and its initializers against the model's parameters as the safetensors headers list them (nothing
loaded). ``check_blocks``: single blocks cut out of the exported graph (the module scopes torch.export's
exporter records on every node), each run on ONNX Runtime with only that block's initializers (streamed by
their external-data offsets) against the same PyTorch block loaded alone from the model's shards, on the
same seeded inputs. Peak memory: the weight-free graph plus one block's weights, twice.

A BlockParityReport is truthy when everything passes; ``raise_for_status()`` raises ParityError (CLI exit 3).
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import ArtifactError, ParityError, RequestError, WrongArtifactError, one_line
from ..graph import onnx_graph
from ..spec import FOLDERS, GraphSpec

if TYPE_CHECKING:
    import onnx
    import torch

    from ..core.store import Artifact
    from ..sources.models import ModelSource
    from .validate import Tolerances

# stages.graph_module registers the network as ``Graph.network``: its parameters and module scopes carry this prefix.
WRAPPER = "network."
# Name scopes the torch.export-based exporter writes on each node: the module path, outermost first
# (torch/onnx/_internal/exporter/_core.py, _set_node_metadata), e.g. ['', 'network', 'network.transformer_blocks.0', …].
SCOPES_KEY = "pkg.torch.onnx.name_scopes"
# The exporter's optimizer merges identical initializers up to this many elements (onnx_ir
# passes/common/initializer_deduplication.py, DeduplicateInitializersPass(size_limit=1024)): freshly
# initialised norm weights (all ones) then share one initializer; larger ones never do.
DEDUP_MAX_ELEMENTS = 1024
# The blocks checked by default, per ModuleList (a path in the network): Flux's first and last double-stream block
# and one single-stream block, SD3's first and last, a UNet's first down block and its last up block (skip
# connections), a text encoder's first and last layer (CLIP's, SDXL's second CLIP's, T5's).
DEFAULT_BLOCKS = {"transformer_blocks": (0, -1), "single_transformer_blocks": (0,), "down_blocks": (0,),
                  "up_blocks": (-1,), "encoder.layers": (0, -1), "text_model.encoder.layers": (0, -1),
                  "encoder.block": (0, -1)}  # fmt: skip
# Arguments whose tensors share a shape and say which is which by the op that made them: diffusers' rotary
# embedding is a (cos, sin) pair (FluxPosEmbed.forward).
MADE_BY = {"image_rotary_emb": ("Cos", "Sin")}
# Tensor methods torch.export turns into copies or nothing, which the exporter's optimizer removes (when the result
# keeps the input's shape and dtype).
GRAPH_IDENTITIES = {"contiguous", "clone", "detach", "to", "type", "type_as", "float", "half", "bfloat16", "view",
                    "view_as", "reshape", "reshape_as", "expand", "expand_as"}  # fmt: skip
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip
COPY_CHUNK = 16 << 20


# ---- the model's parameters, from the safetensors headers ------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    shard: Path
    dtype: str  # numpy-style name
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: 8 bytes of little-endian length, then JSON; the tensors are not read."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return dict(json.loads(f.read(length)))


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model folder's safetensors files (sharded with an index, or one file), by state-dict name."""
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ArtifactError(f"{folder} has no .safetensors weights; save the model with safe_serialization=True")
    out = {}
    for shard in shards:
        for name, entry in safetensors_header(shard).items():
            if name != "__metadata__":
                out[name] = StoredTensor(shard, SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]),
                                         tuple(entry["shape"]))  # fmt: skip
    return out


# ---- graph checks -----------------------------------------------------------------------------------------


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


def check_size(spec: GraphSpec) -> tuple[int, int, int, int]:
    """Batch, height and width in pixels, T5 tokens of the seeded block inputs: small, every axis distinct, so
    tensors are told apart by their shapes (patches 4×6 = 24 latent tokens, 10 text tokens)."""
    return 1, 4 * spec.pixel_multiple, 6 * spec.pixel_multiple, 10


def inputs_label(spec: GraphSpec, batch: int, height: int, width: int, tokens: int) -> str:
    """The check size in words: "batch 1, 32x48 px" (no size for a text encoder; ", 10 T5 tokens" for graphs with a
    T5 axis)."""
    size = f", {height}x{width} px" if spec.reads_pixels else ""
    t5 = f", {tokens} T5 tokens" if spec.default_profile().tokens is not None else ""
    return f"batch {batch}{size}{t5}"


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


def check_graph(graph_path: Path, spec: GraphSpec, model: ModelSource) -> GraphCheck:
    """IO, output shapes inferred at two sizes, parameters: from the weight-free graph and the safetensors headers."""
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
    params = stored_tensors(model.component_dir(folder))
    result.parameters = account_parameters(proto.graph, params, spec.dtype, fp32_modules(model, folder))
    result.failures += result.parameters["failures"]
    return result


# ---- cutting a block out of the graph ----------------------------------------------------------------------


@dataclass
class Cut:
    """A block's subgraph: its file, and its boundary as (name, elem type, shape)."""

    path: Path
    data_inputs: list[tuple[str, int, tuple[int, ...]]]  # values the block computes with
    shape_inputs: list[tuple[str, int, tuple[int, ...]]]  # values only their shape is read of (fed zeros)
    outputs: list[tuple[str, int, tuple[int, ...]]]
    nodes: int
    weight_bytes: int


def node_scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == SCOPES_KEY:
            return [str(s) for s in json.loads(prop.value.replace("'", '"'))]
    return []


def module_scope(name: str) -> str:
    """The scope the exporter names a module of the network by (``named_modules`` names the network itself "")."""
    return WRAPPER + name if name else WRAPPER.rstrip(".")


def innermost_scope(node: onnx.NodeProto) -> str | None:
    """The module whose forward made the node ("" for the export wrapper's); None for a node without scopes. The
    exporter lists the module scopes outermost first, then the node's own name."""
    scopes = node_scopes(node)
    return scopes[-2] if len(scopes) > 1 else None


def is_float(elem_type: int) -> bool:
    import onnx

    return elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                         onnx.TensorProto.DOUBLE)  # fmt: skip


NO_SCOPES = (
    "the graph has no module scopes on its nodes (the TorchScript-based exporter writes none); export it with "
    "--exporter dynamo to check it block by block"
)
QDQ_OPS = ("QuantizeLinear", "DequantizeLinear", "TRT_FP8QuantizeLinear", "TRT_FP8DequantizeLinear")


def graph_modules(graph: onnx.GraphProto) -> list[str]:
    """The network's module paths the graph's nodes carry scopes of (down_blocks.0.resnets.0, …), in graph order."""
    scopes = (scope for node in graph.node for scope in node_scopes(node)[:-1])
    return list(dict.fromkeys(scope[len(WRAPPER) :] for scope in scopes if scope.startswith(WRAPPER)))


def blocks_summary(modules: Sequence[str]) -> str:
    """The network's blocks, a module list as one range: ``down_blocks.0…3, mid_block, up_blocks.0…3`` (a UNet),
    ``embeddings, encoder.layers.0…11, final_layer_norm`` (a CLIP text encoder), ``encoder.embed_tokens,
    encoder.block.0…23, encoder.final_layer_norm`` (T5). A module that only wraps one list (T5's and CLIP's
    ``encoder``, SDXL's ``text_model``) is looked into; one with several (a UNet's mid_block) is a block."""
    children: dict[str, list[str]] = defaultdict(list)
    for module in modules:
        parts = module.split(".")
        for depth in range(len(parts)):
            parent, kid = ".".join(parts[:depth]), parts[depth]
            if kid not in children[parent]:
                children[parent].append(kid)

    def is_list(path: str) -> bool:
        return bool(children[path]) and all(kid.isdigit() for kid in children[path])

    def wraps_one_list(path: str) -> bool:
        inner = [f"{path}.{kid}" for kid in children[path]]
        return sum(is_list(p) or wraps_one_list(p) for p in inner) == 1

    def blocks(path: str) -> list[str]:
        inner = [f"{path}.{kid}".lstrip(".") for kid in children[path]]
        if path and is_list(path):
            indices = [int(kid) for kid in children[path]]
            return [f"{path}.{min(indices)}…{max(indices)}" if len(indices) > 1 else f"{path}.{indices[0]}"]
        if not path or wraps_one_list(path):
            return [block for p in inner for block in blocks(p)]
        return [path]

    return ", ".join(blocks(""))


def check_checkable(artifact: Artifact, blocks: Sequence[str] = ()) -> None:
    """What ``check_blocks`` cannot check, refused (exit 2) from the weight-free graph before any model loads: an
    artifact with no graph (an engine set), a quantized (Q/DQ) graph or one without module scopes
    (WrongArtifactError), a block the graph has no module of or no block named for a graph without DEFAULT_BLOCKS
    (RequestError)."""
    if artifact.primary.suffix != ".onnx":
        raise WrongArtifactError(
            f"{artifact.path} is a {artifact.stage} artifact, which holds no graph: check-blocks checks an export "
            "(the folder `sdtrt export --exporter dynamo` prints, or an export row of `sdtrt cache ls`)"
        )
    graph = onnx_graph.load_graph(artifact.primary).graph
    if artifact.stage == "quantize" or any(node.op_type in QDQ_OPS for node in graph.node):
        raise WrongArtifactError(
            f"{artifact.path} is a quantized (Q/DQ) graph: check-blocks compares the blocks of an export with the "
            "model's fp32 PyTorch blocks, which quantized blocks do not match by design; check the export "
            "(sdtrt export --exporter dynamo), and the quantized graph whole with `sdtrt validate --engine` or layer "
            "by layer with `sdtrt debug`"
        )
    modules = graph_modules(graph)
    if not modules:
        raise WrongArtifactError(NO_SCOPES)
    if not blocks and not any(module.startswith(f"{key}.") for module in modules for key in DEFAULT_BLOCKS):
        raise RequestError(
            f"the graph has none of {', '.join(DEFAULT_BLOCKS)}, the block lists check-blocks picks from by default; "
            f"name blocks with --block (its blocks: {blocks_summary(modules)})"
        )
    if unknown := [b for b in blocks if b not in modules]:
        example = next((m for m in modules if m.count(".") >= 4), max(modules, key=lambda m: m.count(".")))
        raise RequestError(
            f"--block {unknown[0]}: the graph has no module of that name; its blocks: {blocks_summary(modules)} "
            f"(or a module inside one, such as {example})"
        )


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
    block). Outputs are the float values the block makes and something outside it reads.
    """
    import onnx

    graph = proto.graph
    producer = {out: i for i, node in enumerate(graph.node) for out in node.output if out}
    inits = {i.name: i for i in graph.initializer}
    members = block_nodes(graph, block, lambda name: is_float(shapes[name][0]))
    own = set(members)

    def pulled_in(name: str) -> bool:
        node = graph.node[producer[name]]
        if not is_float(shapes[name][0]) or not node.input:
            return True
        if is_argument(name) or {graph.node[i].op_type for i in members if name in graph.node[i].input} == {"Shape"}:
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


# ---- the PyTorch block, loaded alone --------------------------------------------------------------------------


@dataclass
class BlockCall:
    """How the network calls a block at the check size, seen on the meta device: its bound arguments (tensors as
    meta tensors), its output, and the scope each tensor was made in (by id)."""

    arguments: dict[str, Any]
    output: Any
    made_in: dict[int, tuple[Any, str]]  # the tensor, kept so that its id is not reused, and its scope


def meta_network(model: ModelSource, folder: str) -> Any:
    """The network built from its config on the meta device: no weight memory, any size."""
    import importlib

    import torch

    from ..core.progress import quiet_loading

    library, class_name = model.component_class(folder)
    cls = getattr(importlib.import_module(library), class_name)
    config = model.component_config(folder)
    with quiet_loading(), torch.device("meta"):
        if library == "transformers":
            return cls(cls.config_class.from_dict(config)).eval()
        return cls.from_config(config).eval()


def trace_calls(network: Any, spec: GraphSpec, blocks: Sequence[str]) -> dict[str, BlockCall]:
    """Run the graph's forward on the meta device at the check size and record how each block is called."""
    import torch
    from torch.overrides import TorchFunctionMode

    from ..stages.graph_module import graph_module

    made_in: dict[int, tuple[Any, str]] = {}
    calls: dict[str, BlockCall] = {}
    handles = []
    running = [""]  # the scopes of the modules whose forward runs, as the exporter names them (module_scope)

    class RecordScopes(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            result = func(*args, **(kwargs or {}))
            scope = running[-1]
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and id(source) in made_in and is_graph_identity(func, source, result):
                scope = made_in[id(source)][1]
            for _, tensor in tensor_leaves(result):
                made_in.setdefault(id(tensor), (tensor, scope))
            return result

    def enter(name: str) -> Any:
        return lambda module, args: running.append(module_scope(name))

    def leave(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            running.pop()
            if name in blocks:
                bound = inspect.signature(module.forward).bind(*args, **kwargs)
                calls[name] = BlockCall(dict(bound.arguments), output, made_in)

        return hook

    for name, module in network.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name), with_kwargs=True))
    batch, height, width, tokens = check_size(spec)
    feeds = spec.sample_inputs(batch, height, width, tokens=tokens)
    try:
        with torch.no_grad(), RecordScopes():
            graph_module(spec, network)(*(feeds[n].to("meta") for n in spec.input_names))
    finally:
        for handle in handles:
            handle.remove()
    if missing := [b for b in blocks if b not in calls]:
        raise ArtifactError(f"the network never calls {missing[0]}; name a block its forward runs")
    return calls


def is_graph_identity(func: Any, source: torch.Tensor, result: Any) -> bool:
    """Whether ``func`` made ``result`` from ``source`` with no node in the exported graph: a copy or a no-op
    conversion (SD3's ``pos_embed(x).contiguous()`` is, in the graph, pos_embed's own output)."""
    import torch

    return (
        getattr(func, "__name__", "") in GRAPH_IDENTITIES
        and isinstance(result, torch.Tensor)
        and (result.shape, result.dtype) == (source.shape, source.dtype)
    )


def tensor_leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """The tensors in nested tuples, lists and dicts, with their paths."""
    import torch

    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in tensor_leaves(v, (*path, i))]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in tensor_leaves(v, (*path, k))]
    return []


def replace_leaves(value: Any, new: dict[tuple[Any, ...], Any], path: tuple[Any, ...] = ()) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return new[path]
    if isinstance(value, (tuple, list)):
        return type(value)(replace_leaves(v, new, (*path, i)) for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: replace_leaves(v, new, (*path, k)) for k, v in value.items()}
    return value


def stored_names(network: Any, params: dict[str, StoredTensor]) -> dict[str, str]:
    """Each parameter's name → the name the checkpoint stores it under: its own, or for a weight tied to another
    (one tensor under two names, T5's encoder.embed_tokens.weight and shared.weight) the one saved."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in network.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    out = {name: name for name in params}
    for tied in names.values():
        if saved := next((n for n in tied if n in params), None):
            out |= {n: saved for n in tied if n not in params}
    return out


def load_block(network: Any, block: str, params: dict[str, StoredTensor]) -> Any:
    """A copy of the meta network's ``block`` made real in fp32 on the CPU, its tensors read by prefix from the
    shards (the meta network is left as it was, its tied weights tied)."""
    import torch
    from safetensors import safe_open

    module = copy.deepcopy(network.get_submodule(block)).to_empty(device="cpu")
    prefix = block + "."
    by_shard: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for name, saved in stored_names(network, params).items():
        if name.startswith(prefix):
            by_shard[params[saved].shard].append((name, saved))
    stored = {name[len(prefix) :] for names in by_shard.values() for name, _ in names}
    unset = [n for n, _ in module.named_buffers() if n not in stored]
    if unset:
        init_weights = getattr(network, "_init_weights", None)
        if init_weights is None:
            raise ArtifactError(
                f"{block} has buffers the checkpoint does not store ({unset[0]}); it cannot be loaded alone"
            )
        # transformers builds on the meta device and sets the buffers no checkpoint stores (CLIP's position_ids) in
        # _init_weights, as its from_pretrained does (transformers/initialization.py: copy_ into buffers). Only
        # their modules, before loading: _init_weights also draws the weights that loading then replaces.
        for owner in dict.fromkeys(n.rpartition(".")[0] for n in unset):
            init_weights(module.get_submodule(owner))
    state: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            state |= {name[len(prefix) :]: f.get_tensor(saved).to(torch.float32) for name, saved in names}
    module.load_state_dict(state, strict=True)  # every parameter and persistent buffer, or a clear error
    return module.float().eval()


# ---- matching the cut's boundary to the block's arguments and results -------------------------------------------


def upstream_ops(graph: onnx.GraphProto, name: str) -> set[str]:
    """The op types of every node ``name`` depends on (weight-free: graph structure only)."""
    producer = {out: node for node in graph.node for out in node.output if out}
    ops, todo, seen = set(), [name], set()
    while todo:
        node = producer.get(todo.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        ops.add(node.op_type)
        todo += list(node.input)
    return ops


class Arguments:
    """Which block argument a value of the graph is: the arguments of its shape, kept to those made in the module
    that made the value (where the value's node has scopes), then told apart by the op that made them (MADE_BY).

    Made in, not made by: ``silu(temb)`` the exporter computes once inside the first block (a UNet's first resnet)
    and shares has temb's shape, but was made in another module than temb (the UNet's own forward)."""

    def __init__(self, call: BlockCall, graph: onnx.GraphProto, shapes: dict[str, Any]) -> None:
        self.leaves = tensor_leaves(call.arguments)
        self.made_in = {i: scope for i, (_, scope) in call.made_in.items()}
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.graph, self.shapes = graph, shapes

    def same_maker(self, name: str, leaves: list[tuple[tuple[Any, ...], torch.Tensor]]) -> list[Any]:
        """The leaves of the value's shape made in the module the value's node is in (where both are known)."""
        shape = self.shapes[name][1]
        found = [(p, t) for p, t in leaves if tuple(t.shape) == shape]
        scope = innermost_scope(self.producer[name]) if name in self.producer else None
        if scope is not None:
            found = [(p, t) for p, t in found if self.made_in.get(id(t), scope) == scope]
        return found

    def results(self, name: str, output: Any) -> list[tuple[Any, ...]]:
        """The paths of the block's results the cut's output ``name`` can be."""
        return [p for p, _ in self.same_maker(name, tensor_leaves(output))]

    def candidates(self, name: str) -> list[tuple[Any, ...]]:
        found = self.same_maker(name, self.leaves)
        if len(found) > 1:
            ops = upstream_ops(self.graph, name)
            found = [
                (p, t) for p, t in found
                if p[0] in MADE_BY and ops & set(MADE_BY[p[0]]) == {MADE_BY[p[0]][p[1]]}
            ]  # fmt: skip
        return [p for p, _ in found]

    def is_argument(self, name: str) -> bool:
        return bool(self.candidates(name))

    def match(self, names: Sequence[str]) -> dict[str, tuple[Any, ...]]:
        """The argument each of the cut's inputs is; two inputs taken for one argument mean the cut is wrong (it
        reads a value of the block from outside), and fed the same numbers the comparison would mean nothing."""
        matched = {name: self.of(name) for name in names}
        seen: dict[tuple[Any, ...], str] = {}
        for name, path in matched.items():
            if path in seen:
                raise ArtifactError(
                    f"the cut's inputs {seen[path]} and {name} both look like argument "
                    f"{'.'.join(map(str, path))} of the block; it cannot be cut alone, check another block with --block"
                )
            seen[path] = name
        return matched

    def of(self, name: str) -> tuple[Any, ...]:
        found = self.candidates(name)
        if len(found) != 1:
            raise ArtifactError(
                f"cannot tell which argument of the block its input {name} {list(self.shapes[name][1])} is "
                f"({len(found)} candidates); check another block with --block"
            )
        return found[0]


# ---- the check -----------------------------------------------------------------------------------------------


@dataclass
class BlockParityReport:
    graph: str
    model: str
    precision: str
    tolerances: dict[str, float]
    checks: dict[str, Any] = field(default_factory=dict)  # check_graph's result
    blocks: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return not self.failures

    def raise_for_status(self) -> None:
        if self.failures:
            more = f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else ""
            raise ParityError(
                f"the graph does not match the model by parts: {self.failures[0]}{more}; re-export it, "
                "or see the report (--json) for every check"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"passed": bool(self)}


def default_blocks(network: Any) -> list[str]:
    """DEFAULT_BLOCKS of the network's module lists, as paths (transformer_blocks.0, transformer_blocks.18, …)."""
    out = []
    for path, picks in DEFAULT_BLOCKS.items():
        try:
            modules = network.get_submodule(path)
        except AttributeError:
            continue
        if hasattr(modules, "__len__") and len(modules):  # a ModuleList (a module of that name may be no list)
            out += list(dict.fromkeys(f"{path}.{range(len(modules))[i]}" for i in picks))
    return out


def block_tolerances(precision: str) -> Tolerances:
    """validate's tolerances for fp16/bf16; fp32 blocks at cosine 0.9999 (one block, not the whole network)."""
    from dataclasses import replace

    from .validate import Tolerances

    base = Tolerances.for_precision("fp32" if precision == "fp32" else precision)  # type: ignore[arg-type]
    return replace(base, min_cosine=0.9999) if precision == "fp32" else base


def check_blocks(
    model: ModelSource, artifact: Artifact, blocks: Sequence[str] = (), graph_checks: bool = True,
    min_cosine: float | None = None, max_abs: float | None = None,
) -> BlockParityReport:  # fmt: skip
    """Check an export artifact (or an .onnx with a manifest) against its model part by part: ``check_graph``, then
    each block (``blocks``, default: DEFAULT_BLOCKS) cut out and compared with the PyTorch block loaded alone.

    Never loads the graph's weights, nor more than one block of the model's.
    """
    from dataclasses import replace

    from ..core.progress import step

    check_checkable(artifact, blocks)
    spec = onnx_graph.artifact_spec(artifact)
    graph_path = artifact.primary
    tol = block_tolerances(spec.precision)
    tol = replace(tol, **{k: v for k, v in (("min_cosine", min_cosine), ("max_abs", max_abs)) if v is not None})
    report = BlockParityReport(str(graph_path), model.name, spec.precision, asdict(tol))
    if graph_checks:
        with step("Checking the graph's IO, inferred shapes and initializers (weights not loaded)"):
            checked = check_graph(graph_path, spec, model)
        report.checks = asdict(checked)
        report.failures += checked.failures
    folder = FOLDERS[spec.component]
    params = stored_tensors(model.component_dir(folder))
    network = meta_network(model, folder)
    blocks = list(blocks) or default_blocks(network)  # check_checkable saw at least one of them
    proto = onnx_graph.load_graph(graph_path)
    batch, height, width, tokens = check_size(spec)
    shapes = concrete_shapes(proto, spec.input_shapes(batch, height, width, tokens))
    calls = trace_calls(network, spec, blocks)
    work = Path(tempfile.mkdtemp(prefix="sdtrt-blocks-"))
    try:
        for i, block in enumerate(blocks):
            with step(f"Comparing {block} on ONNX Runtime with PyTorch (loaded alone)"):
                arguments = Arguments(calls[block], proto.graph, shapes)
                cut = cut_block(proto, graph_path.parent, block, shapes, work / f"block{i}.onnx", arguments.is_argument)
                row = compare_block(cut, calls[block], arguments, network, block, params, seed=i)
            row["failures"] = [f"{block}: {f}" for f in block_failures(row, tol)]
            report.blocks.append(row)
            report.failures += row["failures"]
            for leftover in work.iterdir():
                leftover.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def compare_block(
    cut: Cut, call: BlockCall, arguments: Arguments, network: Any, block: str, params: dict[str, StoredTensor],
    seed: int,
) -> dict[str, Any]:  # fmt: skip
    """The cut on ONNX Runtime and the PyTorch block on the same seeded arguments: statistics per output.

    Cut outputs that are no result of the block (values the exporter computed once and shares with later blocks)
    are listed, not compared."""
    import onnx
    import onnxruntime as ort
    import torch

    from ..runtime.compare import tensor_stats
    from ..runtime.onnxruntime import session_options

    np_dtype = onnx.helper.tensor_dtype_to_np_dtype
    matched = arguments.match([name for name, _, _ in cut.data_inputs])
    graph_dtype = {matched[name]: np_dtype(elem) for name, elem, _ in cut.data_inputs}
    gen = torch.Generator().manual_seed(seed)
    values = {}
    for path, meta in tensor_leaves(call.arguments):
        if not meta.is_floating_point():
            values[path] = torch.zeros(meta.shape, dtype=meta.dtype)
            continue
        # Rounded through the graph's dtype, so that both sides compute on the same numbers.
        drawn = torch.randn(tuple(meta.shape), generator=gen).numpy()
        values[path] = torch.from_numpy(drawn.astype(graph_dtype.get(path, np.float32)).astype(np.float32))
    feeds = {name: values[matched[name]].numpy().astype(np_dtype(elem)) for name, elem, _ in cut.data_inputs}
    feeds |= {name: np.zeros(shape, np_dtype(elem)) for name, elem, shape in cut.shape_inputs}
    names = [name for name, _, _ in cut.outputs]
    session = ort.InferenceSession(str(cut.path), session_options(), providers=["CPUExecutionProvider"])
    got = dict(zip(names, session.run(names, feeds), strict=True))
    del session
    module = load_block(network, block, params)
    with torch.no_grad():
        # Bound again, so that **kwargs reach the block as keywords (CLIP's layers attend causally by is_causal).
        bound = inspect.BoundArguments(inspect.signature(module.forward), replace_leaves(call.arguments, values))
        expected = dict(tensor_leaves(module(*bound.args, **bound.kwargs)))
    del module  # its weights go before the next block's come
    outputs, side = [], []
    for name in names:
        paths = arguments.results(name, call.output)
        if not paths:
            side.append(name)
            continue
        if any(not torch.equal(expected[p], expected[paths[0]]) for p in paths[1:]):
            raise ArtifactError(f"{block}: the cut's output {name} could be any of {len(paths)} different results "
                                "of the PyTorch block; it cannot be compared")  # fmt: skip
        stats = tensor_stats(torch.from_numpy(got[name]), expected[paths[0]])
        outputs.append({"output": name, "result": ".".join(map(str, paths[0])), "shape": list(got[name].shape)} | stats)
    return {
        "block": block, "nodes": cut.nodes, "weight_bytes": cut.weight_bytes,
        "inputs": {name: ".".join(map(str, path)) for name, path in matched.items()},
        "shape_inputs": [n for n, _, _ in cut.shape_inputs], "not_compared": side,
        "outputs": sorted(outputs, key=lambda out: out["result"]),  # returned[0] before returned[1]
    }  # fmt: skip


def block_failures(row: dict[str, Any], tol: Tolerances) -> list[str]:
    failures = []
    for out in row["outputs"]:
        if not out["finite"]:
            failures.append(f"output {out['output']} contains NaN or inf")
        elif out["cosine"] < tol.min_cosine:
            failures.append(f"output {out['output']}: cosine {out['cosine']:.6f} < {tol.min_cosine}")
        elif out["max_abs"] > tol.max_abs:
            failures.append(f"output {out['output']}: max abs error {out['max_abs']:.3g} > {tol.max_abs}")
    return failures
