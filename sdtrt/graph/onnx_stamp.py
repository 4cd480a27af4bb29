"""Repeated blocks stamped into a graph traced with fewer of them: tracing cost independent of the block count.

A network whose blocks repeat (Flux's 19 double- and 38 single-stream blocks) is traced with STAMP_FROM copies of each
list; torch.export's ONNX exporter labels every node with its module path (metadata ``pkg.torch.onnx.name_scopes``)
and names initializers by state-dict name. Copy 0 computes the symbolic shapes the others reuse, so copy 2 is the
template: an input it takes from copy 1 is the chain (hidden states flowing block to block), one it takes from before
is shared (the time embedding, rotary embedding, shape symbols). Copies 3… are copy 2's nodes again, their chain
inputs wired to the previous copy, their initializers renamed ``…blocks.2.`` → ``…blocks.{i}.``; copy 3, traced as
the last block (whose unread results torch.export drops), is renumbered the list's last and reads the last stamp.
The graph is the full trace's up to value and node names (tests/test_export_stamped.py), before the exporter's
optimizer runs over it. Torch-free: onnx_ir only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..core.errors import ExportError
from .onnx_scopes import NAME_SCOPES, parse_scopes
from .onnx_structure import attribute_key

# Copies traced per repeated list: copy 0 computes the shared shape symbols, copy 1 feeds copy 2, copy 2 is stamped,
# copy 3 is the last (torch.export drops what the last block computes that nothing reads: Flux's single blocks' split).
STAMP_FROM = 4


def stamp_blocks(model: Any, blocks: Mapping[str, int]) -> None:
    """Grow each repeated list of the ``onnx_ir`` model, traced with STAMP_FROM copies, to its full count:
    ``blocks`` maps a list's module path in the graph ("network.transformer_blocks") to that count."""
    for path, count in blocks.items():
        if count > STAMP_FROM:
            _stamp(model.graph, path, count)


def _block_index(node: Any, path: str) -> int | None:
    """Which copy of the list ``path`` the node belongs to, from its module path; None outside the list."""
    scopes = parse_scopes(node.metadata_props.get(NAME_SCOPES))
    start = f"{path}."
    for scope in scopes:
        if scope.startswith(start) and (index := scope[len(start) :].split(".")[0]).isdigit():
            return int(index)
    return None


def _stamp(graph: Any, path: str, count: int) -> None:
    import onnx_ir as ir

    copies: dict[int, list[Any]] = {}
    for node in graph:
        if (index := _block_index(node, path)) is not None:
            copies.setdefault(index, []).append(node)
    if sorted(copies) != list(range(STAMP_FROM)):
        raise ExportError(
            f"cannot stamp {path}: the trace holds copies {sorted(copies)} of it, not 0…{STAMP_FROM - 1}: the graph "
            "does not run the whole list; its spec's repeated_blocks should not name it"
        )
    previous, template = copies[1], copies[2]
    copy_1, copy_2 = _relative_plan(previous, f"{path}.1"), _relative_plan(template, f"{path}.2")
    if copy_1 != copy_2:
        at = next(
            (k for k, (a, b) in enumerate(zip(copy_1, copy_2, strict=False)) if a != b), min(len(copy_1), len(copy_2))
        )
        raise ExportError(
            f"cannot stamp {path}: its copies 1 and 2 differ (from their node {at}): its blocks are not alike; "
            "export with --weights load"
        )
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for n in template for a in n.attributes.values()
    ):
        raise ExportError(f"cannot stamp {path}: its blocks hold subgraphs; export with --weights load")
    _renumber(graph, copies[3], f"{path}.3", f"{path}.{count - 1}")  # the last copy keeps its place, after the stamps
    position = {id(n): k for k, n in enumerate(template)}
    from_previous = {id(out): (k, j) for k, n in enumerate(previous) for j, out in enumerate(n.outputs)}
    own = _scope_pattern(f"{path}.2")

    # Each input slot of the template: ("own", k, j) an earlier template node's output, ("chain", k, j) the previous
    # copy's output, ("weight", value) a block initializer, renamed per copy; ("shared", value) anything else.
    def slot(value: Any) -> tuple[Any, ...]:
        producer = value.producer() if value is not None else None
        if producer is not None and id(producer) in position:
            return ("own", position[id(producer)], value.index())
        if value is not None and id(value) in from_previous:
            return ("chain", *from_previous[id(value)])
        if value is not None and value.is_initializer() and own.search(value.name or ""):
            return ("weight", value)
        return ("shared", value)

    plan = [[slot(v) for v in n.inputs] for n in template]
    shared = {id(w[0]): w[0] for row in plan for kind, *w in row if kind == "shared" and w[0] is not None}
    if between := _between(list(shared.values()), {id(n) for nodes in copies.values() for n in nodes}):
        raise ExportError(
            f"cannot stamp {path}: its blocks are chained through nodes outside them ({between.name}: a value added "
            "between blocks, as a ControlNet's samples are), which stamped copies would skip; its spec's "
            "repeated_blocks should not name it"
        )
    last_outputs = [list(n.outputs) for n in template]
    anchor, stamped = template[-1], set(position)
    for index in range(STAMP_FROM - 1, count - 1):
        scope = f"{path}.{index}"
        outputs: list[list[Any]] = []
        nodes = []
        for node, slots in zip(template, plan, strict=True):
            inputs = []
            for kind, *where in slots:
                if kind == "own":
                    inputs.append(outputs[where[0]][where[1]])
                elif kind == "chain":
                    inputs.append(last_outputs[where[0]][where[1]])
                elif kind == "weight":
                    inputs.append(_initializer(graph, where[0], own.sub(scope, where[0].name)))
                else:
                    inputs.append(where[0])
            clone = ir.Node(
                node.domain, node.op_type, inputs, [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                name=f"{own.sub(scope, node.name or '')}__{index}",
                metadata_props={key: own.sub(scope, value) for key, value in node.metadata_props.items()},
            )  # fmt: skip
            for new, old in zip(clone.outputs, node.outputs, strict=True):
                new.name = f"{old.name}__{index}" if old.name else None
                new.type, new.shape = old.type, old.shape
            outputs.append(list(clone.outputs))
            nodes.append(clone)
            stamped.add(id(clone))
        graph.insert_after(anchor, nodes)
        anchor, last_outputs = nodes[-1], outputs
    # What read copy 2 (the last copy first of all) reads the last stamped copy instead.
    for node, finals in zip(template, last_outputs, strict=True):
        for value, final in zip(node.outputs, finals, strict=True):
            for use in list(value.uses()):
                if id(use.node) not in stamped:
                    use.node.replace_input_with(use.idx, final)
            graph.outputs[:] = [final if output is value else output for output in graph.outputs]


def _between(values: list[Any], copies: set[int]) -> Any:
    """The first of ``values`` made outside the copies (``copies``: their nodes' ids) but computed from what a copy
    gives: a value between the blocks; None if there is none. One a copy makes (copy 0's shape symbols, which the
    others reuse) is not. One walk over their producers' ancestors, each node visited once."""
    seen: set[int] = set()
    for value in values:
        producer = value.producer()
        if producer is None or id(producer) in copies:
            continue
        stack = [producer]
        while stack:
            node = stack.pop()
            if id(node) in copies:
                return value
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.extend(p for v in node.inputs if v is not None and (p := v.producer()) is not None)
    return None


def _relative_plan(nodes: list[Any], scope: str) -> list[tuple[Any, ...]]:
    """A copy's nodes as the stamps repeat them: op, attributes and, per input, the copy's own node output it is, the
    copy's weight (by its name after the block index), or a value from outside the copy."""
    position = {id(n): k for k, n in enumerate(nodes)}
    pattern = _scope_pattern(scope)

    def source(value: Any) -> tuple[Any, ...]:
        producer = value.producer() if value is not None else None
        if producer is not None and id(producer) in position:
            return ("own", position[id(producer)], value.index())
        if value is not None and value.is_initializer() and pattern.search(value.name or ""):
            return ("weight", pattern.sub("", value.name))
        return ("outside", value is None)

    return [
        (n.domain, n.op_type, len(n.outputs), sorted((k, attribute_key(a)) for k, a in n.attributes.items()),
         [source(v) for v in n.inputs])
        for n in nodes
    ]  # fmt: skip


def _scope_pattern(scope: str) -> re.Pattern[str]:
    """``scope`` ("network.blocks.2") as a whole module path in a name or metadata, not "network.blocks.21"."""
    return re.compile(re.escape(scope) + r"(?![0-9])")


def _renumber(graph: Any, nodes: list[Any], scope: str, to: str) -> None:
    """Move a traced copy to another index: its initializers' names and its nodes' module paths."""
    pattern = _scope_pattern(scope)
    for node in nodes:
        node.metadata_props.update({key: pattern.sub(to, value) for key, value in node.metadata_props.items()})
        for value in node.inputs:
            if value is not None and value.is_initializer() and pattern.search(value.name or ""):
                value.name = pattern.sub(to, value.name)


def _initializer(graph: Any, like: Any, name: str) -> Any:
    """The graph's initializer ``name``, made in ``like``'s type and shape where new (its data comes later, by name:
    onnx_weights.attach_weights)."""
    import onnx_ir as ir

    if name not in graph.initializers:
        value = ir.Value(name=name, type=like.type, shape=like.shape)  # never block 2's data under this name
        graph.initializers[name] = value
    return graph.initializers[name]
