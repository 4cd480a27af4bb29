"""Qwen-Image's transformer graph contract (QwenImageTransformer2DModel): packed latents, rotary angles as inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Precision, Range, ShapeProfile, TokenCap
from ..core.errors import ArtifactError
from ..core.families import LLM_TOKENS, QWEN_IMAGE_TUNED_TOKENS
from .transformer import PackedTransformerSpec


@dataclass(frozen=True)
class QwenImageTransformerSpec(PackedTransformerSpec):
    """Qwen-Image: latents packed 2×2 ``[B, (h/2)(w/2), 4C]``, the LLM's last hidden states ``[B, T, 3584]`` with
    their padding mask ``encoder_hidden_states_mask [B, T]`` (int32, 1 a token), the timestep as t / 1000, and the
    rotary embedding's angles as (cos, sin) pairs: ``img_freqs [patches, head/2, 2]``, ``txt_freqs [T, head/2, 2]``
    (fp32). The forward computes them from ``img_shapes``, Python sizes a graph would freeze; the stand-in computes
    them with diffusers' own QwenEmbedRope and the graph rotates by them, as the forward's complex product does."""

    architecture: ClassVar[str] = "QwenImageTransformer2DModel"
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["qwenimage"]
    repeated_blocks: ClassVar[dict[str, str]] = {"transformer_blocks": "num_layers"}
    fp16_problem: ClassVar[str] = (
        "Qwen-Image's transformer is a bf16 model whose activations overflow fp16 into NaN latents, black images "
        "(ComfyUI issue 10751, stable-diffusion.cpp pull request 1249)"
    )
    fp16_fallback: ClassVar[Precision] = "bf16"
    native_latents: ClassVar[int] = 128  # QwenImagePipeline's default_sample_size: 1024 px
    token_cap: ClassVar[TokenCap] = TokenCap(LLM_TOKENS["qwenimage"], "QwenImagePipeline takes", "prompt tokens")

    attention_head_dim: int = 128

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        if taken := [k for k in QWEN_IMAGE_UNBUILT if config.get(k)]:
            raise ArtifactError(
                f"this QwenImageTransformer2DModel sets {', '.join(taken)} (Qwen-Image-Edit's or Layered's "
                "conditioning, or a guidance embedding), which sdtrt's Qwen-Image graph does not take: run it on "
                "PyTorch"
            )
        return {
            "in_channels": config.get("in_channels", 64),
            # proj_out gives patch_size² × (out_channels or in_channels), diffusers' defaults 2, 16, 64
            "out_channels": config.get("patch_size", 2) ** 2
            * (config.get("out_channels", 16) or config.get("in_channels", 64)),
            "cross_attention_dim": config["joint_attention_dim"],
            "pooled_projection_dim": 0,
            "latent_sample_size": cls.native_latents,
            "latent_multiple": 2,
            "attention_head_dim": config.get("attention_head_dim", 128),
        }

    def unread_parameters(self, config: Mapping[str, Any], names: Collection[str]) -> frozenset[str]:
        """The last block's text-stream update, weights and biases: the forward returns the image stream (diffusers'
        QwenImageTransformer2DModel drops the last block's encoder_hidden_states), so its attention's text output
        (``attn.to_add_out``) and text MLP feed no output, and the exporter drops them (tests/test_qwen_image.py
        finds every other parameter in the graph by value, and none of these)."""
        last = f"transformer_blocks.{config['num_layers'] - 1}."
        return frozenset(n for n in names if n.startswith((f"{last}attn.to_add_out.", f"{last}txt_mlp.")))

    def default_profile(self) -> ShapeProfile:
        return dataclasses.replace(super().default_profile(), tokens=qwen_image_tokens())

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        pairs = self.attention_head_dim // 2
        return {
            "hidden_states": (None, ("batch", "patches", self.in_channels)),
            "encoder_hidden_states": (None, ("batch", "tokens", self.cross_attention_dim)),
            "encoder_hidden_states_mask": ("int32", ("batch", "tokens")),
            "timestep": ("float32", ("batch",)),
            "img_freqs": ("float32", ("patches", pairs, 2)),  # the rotary embedding stays fp32
            "txt_freqs": ("float32", ("tokens", pairs, 2)),
        }


# QwenImageTransformer2DModel's config switches of the Edit / Layered models, which the graph does not take.
QWEN_IMAGE_UNBUILT = ("zero_cond_t", "use_layer3d_rope", "use_additional_t_cond", "guidance_embeds")


def qwen_image_tokens() -> Range:
    """Qwen-Image's default prompt tokens (the transformer's): a one-word prompt is a few once the template is dropped,
    tuned for a typical prompt, up to the pipeline's cap."""
    return Range(1, QWEN_IMAGE_TUNED_TOKENS, LLM_TOKENS["qwenimage"])
