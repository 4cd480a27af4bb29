"""A graph's structure up to the names of its nodes and values: two graphs that compute the same thing the same way
(stamped blocks against a full trace: onnx_stamp.py) have equal structures. Torch-free: onnx_ir only.

Each value is named by a digest of how it is made: a graph input by its name, an initializer by its dtype, shape and
bytes, a node's output by the node's domain, op type, attributes and its inputs' digests, and which output it is. The
structure is the multiset of node digests, the graph outputs' digests in order, and the names of the initializers
named by module path (the network's weights: ``transformer_blocks.3.attn.to_q.weight``); the others' names are the
exporter's numbering (its constant folding's ``convert_element_type_default_27``), which differs with the trace.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any


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
        digests[id(value)] = _digest("input", value.name)
    for value in model.graph.initializers.values():
        data = hashlib.sha256(value.const_value.tobytes()).hexdigest() if value.const_value is not None else ""
        digests[id(value)] = _digest("initializer", str(value.dtype), str(value.shape), data)
    nodes: Counter[str] = Counter()
    for node in model.graph:
        attributes = sorted((name, attribute_key(attr)) for name, attr in node.attributes.items())
        inputs = [digests[id(v)] if v is not None else "" for v in node.inputs]
        made = _digest(node.domain, node.op_type, repr(attributes), *inputs)
        nodes[f"{node.op_type}:{made}"] += 1
        for j, output in enumerate(node.outputs):
            digests[id(output)] = _digest(made, str(j))
    weights = frozenset(name for name in model.graph.initializers if "." in name)
    return GraphStructure(nodes, tuple(digests[id(v)] for v in model.graph.outputs), weights)


def attribute_key(attr: Any) -> str:
    value = attr.value
    if hasattr(value, "tobytes"):  # a tensor
        return f"{value.dtype}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return repr(value)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
