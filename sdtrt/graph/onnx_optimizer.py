"""The exporter's optimizer in time linear in the graph: the one quadratic step of onnxscript's rewriter, bounded.

torch 2.13's exporter runs ``onnxscript.optimizer.optimize_ir``, whose RewritePass tries every rule on every node.
A rule whose pattern has several output nodes (``SlicesSplit``: ``Slice(x, …), Slice(x, …)`` → ``Split(x)``) is matched
by onnxscript's ``SimplePatternMatcher.match`` (onnxscript/rewriter/_matcher.py) against every combination of the
node and the graph's nodes of the other outputs' op types, after listing the whole graph by op type: per Slice, a
walk of the graph and a try of every Slice. Flux's thin transformer at full depth (7 523 nodes) spent 1 476 s of its
1 604 s export there. Only nodes that read the value the pattern's outputs share can match (the pattern binds one
variable to one value), so the candidates are that value's readers: the same matches, in time per node bounded by
its readers. A pattern whose outputs share no input keeps onnxscript's search. Torch-free.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def multi_output_matches_by_use() -> Iterator[None]:
    """While inside, onnxscript's multi-output pattern matching takes its candidates from the readers of the value
    the pattern's output nodes share (a private name, ``SimplePatternMatcher.match``: tests/test_export_stamped.py)."""
    from onnxscript.rewriter import _basics, _matcher

    original = _matcher.SimplePatternMatcher.match

    def match(self: Any, model: Any, graph_or_function: Any, node: Any, **options: Any) -> Any:
        outputs = self.pattern.output_nodes
        candidates = None if self.pattern.has_single_output_node else _readers_of_shared_input(outputs, node)
        if candidates is None:
            return original(self, model, graph_or_function, node, **options)
        self._tracer = options.get("tracer")
        self._graph = graph_or_function if hasattr(graph_or_function, "initializers") else graph_or_function.graph
        result = None
        for combination in itertools.product([node], *candidates):
            self._init_match(options.get("verbose", 0))
            result = self._multi_match(combination, check_removable=options.get("remove_nodes", True))
            if result:
                return result
        return result if result is not None else _basics.MatchResult().fail("No match found.")

    _matcher.SimplePatternMatcher.match = match  # type: ignore[method-assign]
    try:
        yield
    finally:
        _matcher.SimplePatternMatcher.match = original  # type: ignore[method-assign]


def _readers_of_shared_input(pattern_nodes: list[Any], node: Any) -> list[list[Any]] | None:
    """For each pattern output node after the first, the graph nodes of its op type that read, at the same input, the
    value ``node`` reads where the first pattern node takes the variable they share; None where one shares none."""
    first, readers = pattern_nodes[0], []
    for other in pattern_nodes[1:]:
        shared = next(
            (
                (i, j)
                for i, a in enumerate(first.inputs)
                for j, b in enumerate(other.inputs)
                if a is b and a is not None
            ),
            None,
        )
        if shared is None or other.op_identifier() is None:
            return None
        value = node.inputs[shared[0]] if shared[0] < len(node.inputs) else None
        if value is None:
            return [[]]
        want = other.op_identifier()
        readers.append([use.node for use in value.uses() if use.idx == shared[1] and use.node.op_identifier() == want])
    return readers
