"""Z-Image's transformer as the graph exports it: the padded batch its spec declares (spec/transformer.py) in, the
denoised patches out, through the network's own embedders, refiners, layers and final layer.

diffusers' forward builds the same padded batch from its lists in Python (per-sample loops, ``pad_sequence``) and
feeds its attention complex rotary factors (``view_as_complex``); neither exports. Here the padding arrives as
inputs and masks, and each attention runs a processor that rotates in real arithmetic by cos/sin factors of the
network's rotary axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..spec import ZImageTransformerSpec
from .patches import replaced

if TYPE_CHECKING:
    import torch


class RealRotaryAttention:
    """ZSingleStreamAttnProcessor's computation with its rotary factors as a real ``[B, S, head_dim / 2, 2]`` (cos,
    sin) tensor instead of complex numbers, and a boolean key mask ``[B, S]`` (None: every key)."""

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        import torch.nn.functional as F

        query, key, value = (
            proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        if attn.norm_q is not None:  # qk_norm
            query, key = attn.norm_q(query), attn.norm_k(key)
        if freqs_cis is not None:
            query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
        mask = None if attention_mask is None else attention_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
        )
        return attn.to_out[0](out.transpose(1, 2).flatten(2, 3).to(query.dtype))


def rotate(x: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``x [B, S, heads, D]`` rotated pairwise (elements 2k, 2k+1 as one complex number) by ``factors``, in fp32."""
    import torch

    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = factors[:, :, None, :, 0], factors[:, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(3).type_as(x)


def rotary_factors(network: Any, ids: torch.Tensor) -> torch.Tensor:
    """The network's rotary factors for positions ``ids [B, S, axes]`` as real ``[B, S, head_dim / 2, 2]`` (cos,
    sin), computed in the graph from its axes and theta: diffusers gathers them from tables it computes in float64,
    here the angles are fp32 products (TensorRT has no float64), which differ by rounding only (about 1e-4 rad at
    position 1000). Constant tables would be weights the model folder lacks, which streamed export refuses."""
    import torch

    embedder, angles = network.rope_embedder, []
    for axis, dim in enumerate(embedder.axes_dims):
        inverse = 1.0 / embedder.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=ids.device) / dim)
        angles.append(ids[..., axis, None].float() * inverse)
    angle = torch.cat(angles, dim=-1)
    return torch.stack((angle.cos(), angle.sin()), dim=-1)


def rotary_patches() -> dict[tuple[Any, str], Any]:
    """Z-Image's attention processor computing as RealRotaryAttention, for the forward and for a block run alone on
    the graph's inputs (check-blocks); ``replaced`` restores diffusers' own after the call (validate's end-to-end
    check runs the same network in diffusers' pipeline next)."""
    from diffusers.models.transformers import transformer_z_image

    return {(transformer_z_image.ZSingleStreamAttnProcessor, "__call__"): RealRotaryAttention.__call__}


def zimage_call(network: Any, spec: ZImageTransformerSpec) -> Callable[..., torch.Tensor]:
    """The graph's forward over the spec's inputs."""
    import torch

    patch = f"{network.all_patch_size[0]}-{network.all_f_patch_size[0]}"

    def forward(
        hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        img_ids: torch.Tensor, txt_ids: torch.Tensor, img_pad: torch.Tensor, txt_pad: torch.Tensor,
        txt_mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        with replaced(rotary_patches()):
            return joint_forward(
                hidden_states, timestep, encoder_hidden_states, img_ids, txt_ids, img_pad, txt_pad, txt_mask
            )

    def joint_forward(
        hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        img_ids: torch.Tensor, txt_ids: torch.Tensor, img_pad: torch.Tensor, txt_pad: torch.Tensor,
        txt_mask: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        adaln = network.t_embedder(timestep * network.t_scale).type_as(hidden_states)
        image = network.all_x_embedder[patch](hidden_states)
        image = torch.where(img_pad[..., None].bool(), network.x_pad_token.to(image.dtype), image)
        image_rotary = rotary_factors(network, img_ids)
        for block in network.noise_refiner:
            image = block(image, None, image_rotary, adaln)
        caption = network.cap_embedder(encoder_hidden_states)
        caption = torch.where(txt_pad[..., None].bool(), network.cap_pad_token.to(caption.dtype), caption)
        caption_rotary, caption_keys = rotary_factors(network, txt_ids), txt_mask.bool()
        for block in network.context_refiner:
            caption = block(caption, caption_keys, caption_rotary)
        # Image, caption, then the caption's batch padding (its keys masked): diffusers' unified sequence, row by row.
        joint = torch.cat((image, caption), dim=1)
        joint_keys = torch.cat((torch.ones_like(img_pad, dtype=torch.bool), caption_keys), dim=1)
        joint_rotary = torch.cat((image_rotary, caption_rotary), dim=1)
        for block in network.layers:
            joint = block(joint, joint_keys, joint_rotary, adaln)
        return network.all_final_layer[patch](joint[:, : hidden_states.shape[1]], c=adaln)  # per token: the image's

    return forward
