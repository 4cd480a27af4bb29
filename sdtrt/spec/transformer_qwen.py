"""Qwen-Image's transformer graph contract (QwenImageTransformer2DModel): packed latents, rotary angles as inputs."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Precision, Range, ShapeProfile, TokenCap
from ..core.errors import ArtifactError
from ..core.families import LLM_TOKENS, QWEN_EDIT_IMAGES, QWEN_IMAGE_EDIT_PIPELINES, QWEN_IMAGE_TUNED_TOKENS
from .base import ModelConfigs
from .qwen_vision import QwenVisionTowerSpec
from .transformer import PackedTransformerSpec

# The image tokens an Edit prompt holds: one condition image of the vision tower's default profile (Qwen2.5-VL's).
EDIT_IMAGE_TOKENS = QwenVisionTowerSpec(precision="bf16", io_naming="named", vae_scale_factor=1).image_tokens()
EDIT_TOKEN_CAP = TokenCap(
    LLM_TOKENS["qwenimage"] + EDIT_IMAGE_TOKENS.max, "QwenImageEditPipeline's transformer reads",
    f"tokens (the prompt's {LLM_TOKENS['qwenimage']} and up to {EDIT_IMAGE_TOKENS.max} of its image)",
)  # fmt: skip


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
    # QwenImageEditPipeline's: its condition image's packed latents follow the generated ones (img_shapes lists both,
    # the rotary tables cover both; the pipeline cuts the output back), that image is ~1024² whatever the output's
    # size (calculate_dimensions): (min, opt, max) patches over aspect ratios 1:3 to 3:1, the max for the pipeline's
    # most images (QWEN_EDIT_IMAGES); and the prompt holds their vision tokens (EDIT_IMAGE_TOKENS: one ~1024² image's,
    # more than the Plus pipeline's three 384² ones). (0, 0, 0): the other pipelines'.
    condition_patches: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "condition_patches", tuple(self.condition_patches))  # a list from JSON

    @classmethod
    def model_fields(cls, model: ModelConfigs) -> dict[str, Any]:
        if model.is_pipeline and model.pipeline_class() in QWEN_IMAGE_EDIT_PIPELINES:
            fewest, square, most = edit_condition_patches()
            return {"condition_patches": (fewest, square, most * QWEN_EDIT_IMAGES[model.pipeline_class()])}
        return {}

    @property
    def edits(self) -> bool:
        return any(self.condition_patches)

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
        """Qwen-Image's tokens; an Edit set's with its condition image's vision tokens too (as its LLM's)."""
        tokens = qwen_image_tokens()
        if self.edits:
            tokens = Range(*(t + i for t, i in zip(tokens, EDIT_IMAGE_TOKENS, strict=True)))
        return dataclasses.replace(super().default_profile(), tokens=tokens)

    def check_profile(self, profile: ShapeProfile) -> None:
        if self.edits:  # its prompt holds the condition image's tokens beside the text's 1024
            profile.check(self.pixel_multiple, EDIT_TOKEN_CAP)
        else:
            super().check_profile(profile)

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        """An Edit set's with a square condition image's patches after the output's: inside each corner's range."""
        sizes = super().axis_sizes(batch, height_px, width_px, tokens)
        return sizes | {"patches": sizes["patches"] + self.condition_patches[1]}

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """An Edit set's: each corner's output patches and the condition image's fewest, square and most."""
        if not self.edits:
            return super().profile_shapes(profile)
        self.check_profile(profile)
        batch, tokens = self.batch_range(profile), profile.tokens or (0, 0, 0)
        corners = []
        for i, extra in enumerate(self.condition_patches):
            sizes = PackedTransformerSpec.axis_sizes(self, batch[i], profile.height[i], profile.width[i], tokens[i])
            corners.append(self.shapes_of(sizes | {"patches": sizes["patches"] + extra}))
        return {name: tuple(c[name] for c in corners) for name in self.input_names}

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.edits:  # the text-to-image sets keep the JSON, and so the keys, they had
            del data["condition_patches"]
        return data

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


@functools.cache
def edit_condition_sizes() -> tuple[tuple[int, int], ...]:
    """QwenImageEditPipeline's condition image sizes (width, height) at aspect ratios 1:3 to 3:1, a square's first:
    its calculate_dimensions of 1024² pixels, written out here (a spec is made before diffusers is imported: the CLI
    refuses a request first; tests/test_qwen_image_edit.py holds these to diffusers' function)."""
    return tuple(
        edit_condition_size(ratio, 1) for ratio in [1.0] + [math.exp(math.log(3) * (i / 1000 - 1)) for i in range(2001)]
    )


def edit_condition_size(width: float, height: float) -> tuple[int, int]:
    """(width, height) of the condition image an Edit pipeline makes of a ``width`` x ``height`` input: diffusers'
    calculate_dimensions of 1024² pixels at its aspect ratio (QwenImageEditInpaintPipeline's output size too)."""
    ratio = width / height
    side = math.sqrt(1024 * 1024 * ratio)
    return round(side / 32) * 32, round(side / ratio / 32) * 32


def edit_condition_patches() -> tuple[int, int, int]:
    """The fewest, a square's and the most patches of an Edit pipeline's condition image (16-pixel patches: the VAE's
    8, packed 2×2)."""
    patches = [(width // 16) * (height // 16) for width, height in edit_condition_sizes()]
    return min(patches), patches[0], max(patches)


def qwen_image_tokens() -> Range:
    """Qwen-Image's default prompt tokens (the transformer's): a one-word prompt is a few once the template is dropped,
    tuned for a typical prompt, up to the pipeline's cap."""
    return Range(1, QWEN_IMAGE_TUNED_TOKENS, LLM_TOKENS["qwenimage"])
