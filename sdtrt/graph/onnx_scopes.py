"""The module scopes torch.export's exporter records on each node (torch/onnx/_internal/exporter/_core.py,
_set_node_metadata): the module path, outermost first, then the node's own name, e.g.
``['', 'network', 'network.transformer_blocks.0', …, 'linear_3']``. Read by block stamping and block parity."""

from __future__ import annotations

import ast

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
# stages.graph_module registers the network as ``Graph.network``: its parameters and module scopes carry this prefix.
WRAPPER = "network."


def parse_scopes(text: str | None) -> list[str]:
    """A node's NAME_SCOPES metadata (a Python list literal) as its scopes; [] where it has none."""
    return [str(scope) for scope in ast.literal_eval(text)] if text else []
