"""The exporter's optimizer in time linear in the graph: the one quadratic step of onnxscript's rewriter, bounded.

torch 2.13's exporter runs ``onnxscript.optimizer.optimize_ir``, whose RewritePass tries every rule on every node.
A rule whose pattern has several output nodes (``SlicesSplit``: ``Slice(x, …), Slice(x, …)`` → ``Split(x)``) is matched
by onnxscript's ``SimplePatternMatcher.match`` (onnxscript/rewriter/_matcher.py) against every combination of the
node and the graph's nodes of the other outputs' op types, in graph order, after listing the whole graph by op type:
per Slice, a walk of the graph and a try of every Slice. Flux's thin transformer at full depth (7 523 nodes) spent
1 476 s of its 1 604 s export there. Where the pattern's output nodes share a named variable (it binds one value),
only that value's readers can match: the candidates are those readers, in graph order, so the first structural match
(the only one the rule then checks) is onnxscript's own. Other patterns keep onnxscript's search, and so does an
onnxscript this private API was not verified against (VERIFIED_ONNXSCRIPT). Torch-free.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import logging
import threading
from collections.abc import Iterator
from typing import Any

# The onnxscript releases whose SimplePatternMatcher.match (and _init_match/_multi_match) the patch reproduces.
VERIFIED_ONNXSCRIPT = ("0.7.2",)

_lock = threading.Lock()
_depth = 0  # exports inside the context, across threads: the class is patched while any is
_original: Any = None  # onnxscript's SimplePatternMatcher.match while patched


@contextlib.contextmanager
def multi_output_matches_by_use() -> Iterator[None]:
    """While inside, onnxscript's multi-output pattern matching takes its candidates from the readers of the value
    the pattern's output nodes share (a private name, ``SimplePatternMatcher.match``: tests/test_export_stamped.py).
    Reentrant and thread-safe: the class is patched on the first entry and restored on the last exit."""
    global _depth, _original
    version = importlib.metadata.version("onnxscript")
    if version not in VERIFIED_ONNXSCRIPT:
        logging.getLogger(__name__).warning(
            "onnxscript %s: its optimizer runs unpatched (slower on long graphs); the bounded search is verified on %s",
            version,
            ", ".join(VERIFIED_ONNXSCRIPT),
        )
        yield
        return
    from onnxscript.rewriter import _matcher

    with _lock:
        if _depth == 0:
            _original = _matcher.SimplePatternMatcher.match
            _matcher.SimplePatternMatcher.match = _bounded(_original)  # type: ignore[method-assign]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _matcher.SimplePatternMatcher.match = _original  # type: ignore[method-assign]


def _bounded(original: Any) -> Any:
    """``SimplePatternMatcher.match`` as onnxscript's ``original``, with the candidates bounded by use."""
    import onnx_ir as ir
    from onnxscript.rewriter import _basics

    positions: dict[int, tuple[Any, dict[int, int]]] = {}  # per graph: node → index, rebuilt for a node new to it

    def in_graph_order(graph: Any, nodes: list[Any]) -> list[Any]:
        if len(nodes) < 2:  # most values have one reader of the op type: nothing to order, no index to rebuild
            return nodes
        held = positions.get(id(graph))
        if held is None or held[0] is not graph or any(id(n) not in held[1] for n in nodes):
            # Nodes inserted since keep the order of those before (the optimizer inserts and removes, never moves).
            held = positions[id(graph)] = (graph, {id(n): k for k, n in enumerate(graph)})
        return sorted(nodes, key=lambda n: held[1][id(n)])

    def match(self: Any, model: Any, graph_or_function: Any, node: Any, **options: Any) -> Any:
        graph = graph_or_function if isinstance(graph_or_function, ir.Graph) else graph_or_function.graph
        readers = None if self.pattern.has_single_output_node else _readers_of_shared_input(self.pattern, node, graph)
        if readers is None:
            return original(self, model, graph_or_function, node, **options)
        self._tracer = options.get("tracer")
        self._graph = graph
        result = None
        for combination in itertools.product([node], *(in_graph_order(graph, r) for r in readers)):
            self._init_match(options.get("verbose", 0))
            result = self._multi_match(combination, check_removable=options.get("remove_nodes", True))
            if result:
                return result
        return result if result is not None else _basics.MatchResult().fail("No match found.")

    return match


def _readers_of_shared_input(pattern: Any, node: Any, graph: Any) -> list[list[Any]] | None:
    """For each pattern output node after the first, the nodes of ``graph`` (not its subgraphs) of its op type that
    read, at the same input, the value ``node`` reads where the first pattern node takes a named variable they share;
    None (onnxscript's own search) where an output node shares none or ``node`` reads no value there."""
    from onnxscript.rewriter import _pattern_ir

    first, readers = pattern.output_nodes[0], []
    if not (first.op.matches(node.op_type) and first.domain.matches(node.domain)):
        # No candidates: ``node`` fails the first output node's first checks (NodePattern.matches), as in onnxscript,
        # which walks the whole graph first for a node that reads no value there (each Constant: the quadratic step).
        return [[] for _ in pattern.output_nodes[1:]]
    for other in pattern.output_nodes[1:]:
        shared = next(
            (
                (i, j)
                for i, a in enumerate(first.inputs)
                for j, b in enumerate(other.inputs)
                if a is b and type(a) is _pattern_ir.Var and a.name  # bound by name: one value (not ANY_VALUE)
            ),
            None,
        )
        want = other.op_identifier()
        if shared is None or want is None or shared[0] >= len(node.inputs) or node.inputs[shared[0]] is None:
            return None
        i, j = shared
        readers.append(
            [
                u.node
                for u in node.inputs[i].uses()
                if u.idx == j and u.node.graph is graph and u.node.op_identifier() == want
            ]
        )
    return readers
