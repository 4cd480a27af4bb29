"""Z-Image's transformer graph contract (ZImageTransformer2DModel): a padded batch behind diffusers' list call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Precision
from ..core.families import LLM_TOKENS
from .base import TensorSpec
from .transformer import TransformerSpec


@dataclass(frozen=True)
class ZImageTransformerSpec(TransformerSpec):
    """Z-Image: its forward takes Python lists (a latent ``[C, 1, h, w]`` and a caption ``[L_i, cap_feat_dim]`` per
    sample, L_i each prompt's own token count), which no graph takes; the graph takes the padded batch diffusers'
    forward builds from them instead, with what the padding means as masks. The stand-in converts with the
    diffusers class's own patchify and unpatchify, so the pipeline's call and its list of outputs stay as they are:

    - ``hidden_states [B, patches, 4C]``: 2×2 patches, padded to a multiple of 32 (``img_pad`` 1 at the pad tokens,
      which become the model's x_pad_token and are attended to, as in diffusers);
    - ``encoder_hidden_states [B, tokens, cap_feat_dim]``: each caption padded to a multiple of 32 (``txt_pad``: the
      cap_pad_token there), then to the batch's longest (``txt_mask`` 0 there: no token attends to them);
    - ``img_ids [B, patches, 3]`` / ``txt_ids [B, tokens, 3]``: the rotary positions (an image's start after its
      own caption, so they differ per sample); ``timestep [B]`` as the pipeline passes it, (1000 - t) / 1000.

    Padded forms keep the sequence axes dynamic (a profile axis each) where a per-sample form would need one graph
    per length; classifier-free guidance doubles B (positive and negative prompts in one call, as the pipeline
    makes it). The output is the denoised patches ``[B, patches, 4C]``, which the stand-in unpatchifies."""

    architecture: ClassVar[str] = "ZImageTransformer2DModel"
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["zimage"]
    fp16_problem: ClassVar[str] = (
        "Z-Image is trained and shipped in bf16 and its feed-forward and block activations overflow fp16 into NaN "
        "(black images: Tongyi-MAI/Z-Image issue 14, ComfyUI pull requests 11057 and 11187)"
    )
    fp16_fallback: ClassVar[Precision] = "bf16"
    timestep_scale: ClassVar[float] = 1e-3
    grid: ClassVar[dict[str, str]] = {}
    sequence_multiple: ClassVar[int] = 32  # diffusers' SEQ_MULTI_OF: both sequences are padded to it per sample

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        patch = config.get("all_patch_size", [2])[0] ** 2 * config.get("all_f_patch_size", [1])[0]
        return {
            "in_channels": patch * config.get("in_channels", 16),
            "out_channels": patch * config.get("in_channels", 16),
            "cross_attention_dim": config["cap_feat_dim"],
            "pooled_projection_dim": 0,
            "latent_sample_size": vae.get("sample_size", 1024) // vae_scale_factor,  # ZImagePipeline's 1024 px
            "latent_multiple": config.get("all_patch_size", [2])[0],
        }

    @property
    def doubles_batch(self) -> bool:
        return True

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        sizes = super().axis_sizes(batch, height_px, width_px, tokens)
        return sizes | {axis: -(-sizes[axis] // self.sequence_multiple) * self.sequence_multiple
                        for axis in ("patches", "tokens")}  # fmt: skip

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        return {
            "hidden_states": (None, ("batch", "patches", self.in_channels)),
            "timestep": ("float32", ("batch",)),
            "encoder_hidden_states": (None, ("batch", "tokens", self.cross_attention_dim)),
            "img_ids": ("int32", ("batch", "patches", 3)),
            "txt_ids": ("int32", ("batch", "tokens", 3)),
            "img_pad": ("int32", ("batch", "patches")),
            "txt_pad": ("int32", ("batch", "tokens")),
            "txt_mask": ("int32", ("batch", "tokens")),
        }

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", "patches", self.out_channels))]
