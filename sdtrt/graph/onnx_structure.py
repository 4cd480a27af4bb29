"""A graph's structure up to the names of its nodes and values: two graphs that compute the same thing the same way
(stamped blocks against a full trace: onnx_stamp.py) have equal structures. Torch-free: onnx_ir only.

Each value is named by a digest of how it is made: a graph input by its name, type and shape, an initializer by its
dtype, shape and bytes, a node's output by the node's domain, op type, attributes, module scopes (which block
parity cuts the graph by) and its inputs' digests, which output it is, and its type and shape (up to the names of
symbolic dimensions). The structure is the multiset of node digests, the graph outputs' digests in order, and the
names of the initializers named by module path (the network's weights: ``transformer_blocks.3.attn.to_q.weight``);
the others' names are the exporter's numbering (its constant folding's ``convert_element_type_default_27``), which
differs with the trace.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .onnx_scopes import NAME_SCOPES, parse_scopes


@dataclass(frozen=True)
class GraphStructure:
    nodes: Counter[str]
    outputs: tuple[str, ...]
    weights: frozenset[str]

    def differences(self, other: GraphStructure) -> list[str]:
        """What differs, for people: node digests one graph has more of (with the op type), and the outputs."""
        found = [f"{len(self.nodes - other.nodes)} node(s) only in the first: {sorted(self.nodes - other.nodes)[:5]}"]
        found += [f"{len(other.nodes - self.nodes)} node(s) only in the second: {sorted(other.nodes - self.nodes)[:5]}"]
        found = [line for line in found if not line.startswith("0 ")]
        if self.outputs != other.outputs:
            found.append("the graph outputs are computed differently")
        if self.weights != other.weights:
            found.append(f"weights only in the first: {sorted(self.weights - other.weights)[:5]}, "
                         f"only in the second: {sorted(other.weights - self.weights)[:5]}")  # fmt: skip
        return found


def graph_structure(model: Any) -> GraphStructure:
    """The structure of an ``onnx_ir`` model's main graph (``onnx_ir.load(path)``); its initializers' bytes are read
    one at a time."""
    digests: dict[int, str] = {}
    for value in model.graph.inputs:
        digests[id(value)] = _digest("input", value.name, str(value.type), _shape(value.shape))
    for value in model.graph.initializers.values():
        data = hashlib.sha256(value.const_value.tobytes()).hexdigest() if value.const_value is not None else ""
        digests[id(value)] = _digest("initializer", str(value.dtype), str(value.shape), data)
    nodes: Counter[str] = Counter()
    for node in model.graph:
        attributes = sorted((name, attribute_key(attr)) for name, attr in node.attributes.items())
        inputs = [digests[id(v)] if v is not None else "" for v in node.inputs]
        modules = parse_scopes(node.metadata_props.get(NAME_SCOPES))[:-1]  # the last is the node's own name
        made = _digest(node.domain, node.op_type, repr(attributes), repr(modules), *inputs)
        nodes[f"{node.op_type}:{made}"] += 1
        for j, output in enumerate(node.outputs):
            digests[id(output)] = _digest(made, str(j), str(output.type), _shape(output.shape))
    weights = frozenset(name for name in model.graph.initializers if "." in name)
    return GraphStructure(nodes, tuple(digests[id(v)] for v in model.graph.outputs), weights)


def attribute_key(attr: Any) -> str:
    value = attr.value
    if hasattr(value, "tobytes"):  # a tensor
        return f"{value.dtype}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return repr(value)


def _shape(shape: Any) -> str:
    """A value's shape up to the names of its symbolic dimensions (the exporter names them after optimizing)."""
    return "unknown" if shape is None else repr([d if isinstance(d, int) else "symbolic" for d in shape])


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
