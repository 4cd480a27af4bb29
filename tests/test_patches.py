"""The export patches (broadcast_to → expand, concat → cat): scoped, reversible, and visible in the exported graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from sdtrt.stages.patches import EXPORT_PATCHES, broadcast_to_as_expand, concat_as_cat, export_patches

TORCH_RMS_NORM = torch.nn.functional.rms_norm


class UsesBroadcastTo(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return torch.broadcast_to(x, like.shape) * y.broadcast_to(like.shape) + like


class ConcatsMixedDtypes(torch.nn.Module):
    """diffusers' get_aug_embed in an fp16 SDXL UNet: fp16 text embeddings joined with fp32 time embeddings."""

    def forward(self, text_embeds: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
        time_embeds = (time_ids.float() * torch.arange(1, 4, dtype=torch.float32)).sin()
        joined = torch.concat([text_embeds, time_embeds], dim=-1)
        return torch.concatenate([joined, text_embeds], axis=-1)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_broadcast_to_exports_as_expand_under_the_patch(tmp_path, dynamo):
    path = tmp_path / "m.onnx"
    args = (torch.randn(1, 3), torch.randn(4, 1), torch.randn(4, 3))
    with export_patches("dynamo" if dynamo else "torchscript") as applied:
        torch.onnx.export(UsesBroadcastTo(), args, str(path), dynamo=dynamo, input_names=["x", "y", "like"])
    torchscript_only = [] if dynamo else ["rms_norm->arithmetic", "flux rotary: unflatten", "nearest-exact xN->nearest"]
    assert applied == ["broadcast_to->expand", "concat->cat", *torchscript_only]
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Expand") == 2, ops


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_mixed_dtype_concat_exports_type_promoted_as_eager_computes_it(tmp_path, dynamo):
    path = tmp_path / "m.onnx"
    args = (torch.randn(2, 3, dtype=torch.float16), torch.randn(2, 3))
    want = ConcatsMixedDtypes()(*args)
    assert want.dtype == torch.float32  # eager promotes fp16 ⊕ fp32
    with export_patches():
        torch.onnx.export(ConcatsMixedDtypes(), args, str(path), dynamo=dynamo, input_names=["text_embeds", "time_ids"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])  # refused a mixed Concat
    (got,) = session.run(None, {"text_embeds": args[0].numpy(), "time_ids": args[1].numpy()})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("patch", [broadcast_to_as_expand, concat_as_cat])
def test_patch_is_undone_on_exit_and_on_error(patch):
    originals = torch.broadcast_to, torch.Tensor.broadcast_to, torch.concat, torch.concatenate
    with patch():
        assert (torch.broadcast_to, torch.Tensor.broadcast_to, torch.concat, torch.concatenate) != originals
        assert torch.broadcast_to(torch.ones(1, 2), (3, 2)).shape == (3, 2)
        assert torch.concatenate([torch.ones(1, 2)] * 2, axis=-1).shape == (1, 4)
    assert (torch.broadcast_to, torch.Tensor.broadcast_to, torch.concat, torch.concatenate) == originals
    with pytest.raises(RuntimeError), patch():
        raise RuntimeError("export failed")
    assert (torch.broadcast_to, torch.Tensor.broadcast_to, torch.concat, torch.concatenate) == originals
    assert patch in EXPORT_PATCHES.values()


def test_rms_norm_exports_through_torchscript_under_its_patch(tmp_path):
    """The TorchScript exporter has no aten::rms_norm; the patch writes it out with the same values."""
    norm = torch.nn.RMSNorm(8, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 3, 8)
    with export_patches("torchscript") as applied:
        assert torch.allclose(norm(x), torch.nn.RMSNorm.forward(norm, x), atol=1e-6)
        torch.onnx.export(norm, (x,), str(tmp_path / "n.onnx"), dynamo=False, input_names=["x"])
    assert "rms_norm->arithmetic" in applied and torch.nn.functional.rms_norm is TORCH_RMS_NORM
    (got,) = ort.InferenceSession(str(tmp_path / "n.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()}
    )
    np.testing.assert_allclose(got, norm(x).detach().numpy(), rtol=1e-5, atol=1e-5)
