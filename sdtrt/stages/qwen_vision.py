"""Qwen2.5-VL's vision tower as the graph exports it (spec/qwen_vision.py): its own patch embedding, blocks and patch
merger on the patches in window order, attention masked from each patch's window and frame instead of split by
``cu_seqlens`` (a Python list in transformers' forward), which gives the same sums: a patch attends to the patches
of its segment alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..spec import QwenVisionTowerSpec


def segment_mask(segments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[1, 1, S, S]`` mask that keeps each position's attention inside its segment (no row is empty:
    a position is in its own segment)."""
    import torch

    same = segments[:, None] == segments[None, :]
    return torch.zeros(same.shape, dtype=dtype).masked_fill(~same, torch.finfo(dtype).min)[None, None]


def vision_call(network: Any, spec: QwenVisionTowerSpec) -> Callable[..., torch.Tensor]:
    """The graph's forward: (pixel_values, cos, sin, and the spec's window_segments and frame_segments: those its
    blocks attend within) → the merged image embeddings, in window order. Each block is the network's own norms,
    projections and MLP; the attention is transformers' (its rotary product, softmax over the scaled scores) on one
    masked sequence."""
    import torch
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    visual = network.model.visual

    def attention(attn: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> Any:
        count = hidden.shape[0]
        query, key, value = attn.qkv(hidden).reshape(count, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        query, key = apply_rotary_pos_emb_vision(query, key, cos, sin)
        query, key, value = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=attn.scaling)
        return attn.proj(out[0].transpose(0, 1).reshape(count, -1))

    def forward(pixel_values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *segments: torch.Tensor) -> Any:
        hidden = visual.patch_embed(pixel_values)
        names = spec.canonical_inputs[3:]
        masks = {name: segment_mask(ids, hidden.dtype) for name, ids in zip(names, segments, strict=True)}
        for index, block in enumerate(visual.blocks):
            mask = masks["frame_segments" if index in visual.fullatt_block_indexes else "window_segments"]
            hidden = hidden + attention(block.attn, block.norm1(hidden), cos, sin, mask)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden)

    return forward
