"""Matching the cut's boundary to the block's arguments and results: which argument each of the cut's inputs is,
which result each of its outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ...core.errors import ArtifactError
from .scopes import innermost_scope
from .torch_block import tensor_leaves

if TYPE_CHECKING:
    import onnx
    import torch

    from .torch_block import BlockCall

# Arguments whose tensors share a shape and say which is which by the op that made them: diffusers' rotary
# embedding is a (cos, sin) pair (FluxPosEmbed.forward), and so is transformers' (an LLM layer's position_embeddings).
MADE_BY = {"image_rotary_emb": ("Cos", "Sin"), "position_embeddings": ("Cos", "Sin")}


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
        """The leaves of the value's shape and kind (floating point or not) made in the module the value's node is in
        (where both are known): Z-Image's text mask [B, T] is no timestep embedding [B, D] where T is D."""
        import onnx

        elem, shape = self.shapes[name]
        floating = onnx.helper.tensor_dtype_to_np_dtype(elem).kind == "f"
        found = [(p, t) for p, t in leaves if tuple(t.shape) == shape and t.is_floating_point() == floating]
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
