"""The broadcast_to → expand export patch: scoped, reversible, and visible in the exported graph."""

from __future__ import annotations

import onnx
import pytest
import torch

from sdtrt.patches import broadcast_to_as_expand, export_patches


class UsesBroadcastTo(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return torch.broadcast_to(x, like.shape) * y.broadcast_to(like.shape) + like


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_broadcast_to_exports_as_expand_under_the_patch(tmp_path, dynamo):
    path = tmp_path / "m.onnx"
    args = (torch.randn(1, 3), torch.randn(4, 1), torch.randn(4, 3))
    with export_patches() as applied:
        torch.onnx.export(UsesBroadcastTo(), args, str(path), dynamo=dynamo, input_names=["x", "y", "like"])
    assert applied == ["broadcast_to->expand"]
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Expand") == 2, ops


def test_patch_is_undone_on_exit_and_on_error():
    original_fn, original_method = torch.broadcast_to, torch.Tensor.broadcast_to
    with broadcast_to_as_expand():
        assert torch.broadcast_to is not original_fn
        assert torch.broadcast_to(torch.ones(1, 2), (3, 2)).shape == (3, 2)
    assert torch.broadcast_to is original_fn and torch.Tensor.broadcast_to is original_method
    with pytest.raises(RuntimeError), broadcast_to_as_expand():
        raise RuntimeError("export failed")
    assert torch.broadcast_to is original_fn and torch.Tensor.broadcast_to is original_method
