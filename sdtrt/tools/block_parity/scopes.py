"""The module scopes torch.export's exporter records on every node: which module of the network made a node, and
the network's blocks as the graph's scopes name them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...graph.onnx_scopes import NAME_SCOPES, WRAPPER, parse_scopes

if TYPE_CHECKING:
    import onnx

NO_SCOPES = (
    "the graph has no module scopes on its nodes (the TorchScript-based exporter writes none); export it with "
    "--exporter dynamo to check it block by block"
)


def node_scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES:
            return parse_scopes(prop.value)
    return []


def module_scope(name: str) -> str:
    """The scope the exporter names a module of the network by (``named_modules`` names the network itself "")."""
    return WRAPPER + name if name else WRAPPER.rstrip(".")


def innermost_scope(node: onnx.NodeProto) -> str | None:
    """The module whose forward made the node ("" for the export wrapper's); None for a node without scopes. The
    exporter lists the module scopes outermost first, then the node's own name."""
    scopes = node_scopes(node)
    return scopes[-2] if len(scopes) > 1 else None


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
