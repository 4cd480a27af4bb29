"""Qwen-Image's transformer as the graph exports it: the rotary embedding's angles come in as inputs.

``QwenImageTransformer2DModel.forward`` computes its rotary embedding from ``img_shapes`` (Python sizes, which a traced
graph would freeze) as complex numbers (which ONNX has no type for). The graph takes the angles as (cos, sin) pairs
(``img_freqs``, ``txt_freqs``: what the stand-in computes with diffusers' own QwenEmbedRope) and rotates each query
and key pair by them in real arithmetic, the same product as the forward's ``x * freqs`` over complex numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .patches import replaced

if TYPE_CHECKING:
    import torch


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """``apply_rotary_emb_qwen(x [B, S, H, D], freqs_cis, use_real=False)`` with ``freqs`` the angles' (cos, sin)
    ``[S, D/2, 2]``: each (even, odd) pair of x, as a complex number, times cos + i·sin, in fp32."""
    import torch

    real, imag = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # not reshape(*x.shape…): traced as constants
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(3).type_as(x)


def text_mask(encoder_hidden_states: torch.Tensor, mask: torch.Tensor) -> tuple[int, None, torch.Tensor]:
    """``compute_text_seq_len_from_mask`` for the graph's boolean mask: the forward reads its first and last values
    alone (the per-row lengths it discards are made with ``torch.as_tensor`` of the token count, which pins that
    axis to the traced one under torch.export)."""
    return encoder_hidden_states.shape[1], None, mask


def rotary_patches() -> dict[tuple[Any, str], Any]:
    """The rotary product on (cos, sin) pairs, for the forward and for a block run alone on the graph's inputs
    (check-blocks)."""
    from diffusers.models.transformers import transformer_qwenimage

    return {(transformer_qwenimage, "apply_rotary_emb_qwen"): rotate_pairs}


def qwen_transformer_call(network: Any) -> Callable[..., torch.Tensor]:
    """The graph's forward: the network's own, its rotary embedding the graph's inputs."""
    from diffusers.models.transformers import transformer_qwenimage

    def forward(
        hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor,
        timestep: torch.Tensor, img_freqs: torch.Tensor, txt_freqs: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        def given_rotary(*_: Any, **__: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return img_freqs, txt_freqs

        patches = {
            (network.pos_embed, "forward"): given_rotary,
            **rotary_patches(),
            (transformer_qwenimage, "compute_text_seq_len_from_mask"): text_mask,
        }
        with replaced(patches):
            return network(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask.bool(), timestep=timestep, img_shapes=None,
                return_dict=False,
            )[0]  # fmt: skip

    return forward
