"""Transformer denoisers' graph contracts: SD3 / SD3.5 (MMDiT), Flux.1 and FLUX.2 (DiTs on packed latents), Z-Image.

Optimum's ``SD3TransformerOnnxConfig`` / ``FluxTransformerOnnxConfig`` and NVIDIA demo/Diffusion's
``model/diffusion_transformer.py`` declare the same IO. Inputs are named as the diffusers forward's
keyword arguments, so the exported wrapper passes them by name.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision, Range, ShapeProfile, TokenCap
from ..core.errors import ArtifactError
from ..core.families import (
    LLM_TOKENS,
    QWEN_IMAGE_TUNED_TOKENS,
    REFERENCE_TOKEN_PIPELINES,
    T5_TOKENS,
    transformer_family,
)
from .base import NAMED_OUTPUT, ModelConfigs, TensorSpec, token_range
from .denoiser import DenoiserSpec

# FLUX.2 [klein]'s engines (its LLM's and its transformer's) take the pipeline's max_sequence_length default at most.
klein_token_cap = TokenCap(LLM_TOKENS["flux2"], "sdtrt's FLUX.2 [klein] engines take")


@dataclass(frozen=True)
class TransformerSpec(DenoiserSpec):
    """What SD3's and Flux's transformers share: hidden states, text and pooled embeddings, a timestep, and T5's
    token count as a profile axis. ``for_model`` / ``from_json`` pick the kind from the transformer's class."""

    component: ClassVar[Component] = "transformer"
    label: ClassVar[str] = "transformer"
    canonical_outputs: ClassVar[tuple[str, ...]] = (NAMED_OUTPUT,)

    pooled_projection_dim: int = 2048
    out_channels: int = 16
    max_sequence_length: int = 256  # T5's default token count (the pipelines' max_sequence_length)
    # max_sequence_length when the pipeline is called without one (the profile covers it too).
    pipeline_tokens: ClassVar[int]

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> TransformerSpec:
        """This component's contract for ``model``: its latent grid from the transformer's and VAE's configs."""
        config = model.component_config("transformer")
        kind = _kind(config.get("_class_name", ""))
        factor = model.vae_scale_factor()
        vae = model.component_config("vae") if model.has("vae") else {}
        pipeline = model.pipeline_class() if model.is_pipeline else ""
        return kind(
            precision=precision, io_naming=io_naming, vae_scale_factor=factor,
            **kind.fields_from(config, vae, factor) | kind.pipeline_fields(pipeline),
            max_sequence_length=T5_TOKENS.get(transformer_family(config), kind.pipeline_tokens),
        )  # fmt: skip

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def pipeline_fields(cls, pipeline_class: str) -> dict[str, Any]:
        """The fields the pipeline class (model_index.json's) sets: how it calls the transformer."""
        return {}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        """The recorded kind's spec (a manifest names the transformer's class)."""
        if cls is TransformerSpec:
            return _kind(data.get("architecture", "")).from_json(data)
        return super().from_json(data)

    @property
    def default_tokens(self) -> int:
        return self.max_sequence_length

    @property
    def output_name(self) -> str:
        return self.output_names[0]

    def default_profile(self) -> ShapeProfile:
        profile = ShapeProfile.around(self.latent_sample_size * self.vae_scale_factor, self.pixel_multiple)
        return dataclasses.replace(
            profile, guidance=self.doubles_batch, tokens=token_range(self.max_sequence_length, self.pipeline_tokens)
        )

    @property
    def doubles_batch(self) -> bool:
        """Whether classifier-free guidance doubles the batch (SD3), or runs without (Flux)."""
        raise NotImplementedError

    def inputs(self) -> list[TensorSpec]:
        shapes = self.graph_tensors()
        return [
            TensorSpec(name, dtype or self.dtype, shape)
            for name, (dtype, shape) in zip(self.input_names, shapes.values(), strict=True)
        ]

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        """Canonical name → (dtype, None for the graph's; shape), in graph order: the network's forward arguments."""
        raise NotImplementedError

    def graph_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        """``input_tensors``, then an IP-Adapter's (its scales fp32)."""
        fp32 = self.fixed_inputs()
        ip_adapter = {name: ("float32" if name in fp32 else None, shape) for name, shape in self.ip_adapter_tensors()}
        return self.input_tensors() | ip_adapter

    @property
    def canonical_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.graph_tensors())


@dataclass(frozen=True)
class SD3TransformerSpec(TransformerSpec):
    """SD3 / SD3.5: latents ``[B, 16, h, w]``, CLIP-L + CLIP-G + T5 tokens ``[B, 77 + T, joint_attention_dim]``,
    pooled CLIP ``[B, 2048]``; classifier-free guidance doubles B. Latents are cut into patch_size² patches."""

    architecture: ClassVar[str] = "SD3Transformer2DModel"
    pipeline_tokens: ClassVar[int] = 256  # StableDiffusion3Pipeline's

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        return {
            "in_channels": config.get("in_channels", 16),
            "out_channels": config.get("out_channels", 16),
            "cross_attention_dim": config["joint_attention_dim"],
            "pooled_projection_dim": config["pooled_projection_dim"],
            "latent_sample_size": config.get("sample_size", 128),
            "latent_multiple": config.get("patch_size", 2),
        }

    @property
    def doubles_batch(self) -> bool:
        return True

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        return {
            "hidden_states": (None, ("batch", self.in_channels, "height", "width")),
            "timestep": ("float32", ("batch",)),  # fp32 in every graph, as the UNet's
            "encoder_hidden_states": (None, ("batch", "text_tokens", self.cross_attention_dim)),
            "pooled_projections": (None, ("batch", self.pooled_projection_dim)),
        }

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", self.out_channels, "height", "width"))]


@dataclass(frozen=True)
class PackedTransformerSpec(TransformerSpec):
    """What Flux.1's and FLUX.2's transformers share: latents packed into patches ``[B, patches, C]`` and denoised
    as such, no batch doubling (true CFG runs two passes at B), the timestep as the schedule's t / 1000."""

    timestep_scale: ClassVar[float] = 1e-3
    grid: ClassVar[dict[str, str]] = {}  # no latent height/width among the inputs: pixel_multiple says it

    @property
    def doubles_batch(self) -> bool:
        return False

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", "patches", self.out_channels))]


@dataclass(frozen=True)
class FluxTransformerSpec(PackedTransformerSpec):
    """Flux.1: latents packed 2×2 ``[B, (h/2)(w/2), 64]`` with their positions ``img_ids [(h/2)(w/2), 3]``, T5 tokens
    ``[B, T, 4096]`` with ``txt_ids [T, 3]``, pooled CLIP-L ``[B, 768]``; dev embeds ``guidance [B]``."""

    architecture: ClassVar[str] = "FluxTransformer2DModel"
    pipeline_tokens: ClassVar[int] = 512  # FluxPipeline's, dev's and schnell's alike
    repeated_blocks: ClassVar[dict[str, str]] = {
        "transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers",
    }  # fmt: skip

    guidance_embeds: bool = True
    # Kontext: the reference image's packed latents follow the generated ones in hidden_states and img_ids (and the
    # output, which the pipeline cuts back); the reference is resized to a preferred resolution (reference_sizes).
    reference_tokens: bool = False

    @classmethod
    def pipeline_fields(cls, pipeline_class: str) -> dict[str, Any]:
        return {"reference_tokens": True} if pipeline_class in REFERENCE_TOKEN_PIPELINES else {}

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        """Kontext's with a reference as many tokens as the output, at most a preferred resolution's: validate's and
        bench's seeded inputs, inside the profile at each of its corners."""
        sizes = super().axis_sizes(batch, height_px, width_px, tokens)
        if not self.reference_tokens:
            return sizes
        return with_reference(sizes, min(sizes["patches"], self.most_reference_patches))

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Kontext's: no reference at the minimum (text-to-image, no --image), one of the output's size at the
        optimum, the preferred resolution of most tokens at the maximum (a default diffusers call fits)."""
        if not self.reference_tokens:
            return super().profile_shapes(profile)
        self.check_profile(profile)
        batch, tokens = self.batch_range(profile), profile.tokens or (0, 0, 0)
        most = self.most_reference_patches
        corners = []
        for i, extra in enumerate((0, min(self.patches(profile.height.opt, profile.width.opt), most), most)):
            sizes = super().axis_sizes(batch[i], profile.height[i], profile.width[i], tokens[i])
            corners.append(self.shapes_of(with_reference(sizes, extra)))
        return {name: tuple(c[name] for c in corners) for name in self.input_names}

    @property
    def most_reference_patches(self) -> int:
        """The tokens of Kontext's preferred reference resolution of most tokens, at this model's native size."""
        native = self.latent_sample_size * self.vae_scale_factor
        return max(self.patches(h, w) for h, w in reference_sizes(native, self.pixel_multiple))

    def patches(self, height_px: int, width_px: int) -> int:
        """The tokens an image of this size packs into."""
        return (height_px // self.pixel_multiple) * (width_px // self.pixel_multiple)

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.reference_tokens:  # Flux's other sets keep the JSON, and so the keys, they had
            del data["reference_tokens"]
        return data

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        return {
            "in_channels": config.get("in_channels", 64),
            "out_channels": config.get("out_channels") or config.get("in_channels", 64),
            "cross_attention_dim": config["joint_attention_dim"],
            "pooled_projection_dim": config["pooled_projection_dim"],
            # FluxPipeline's default size is the VAE's sample_size (1024 px for Flux.1).
            "latent_sample_size": vae.get("sample_size", 1024) // vae_scale_factor,
            "latent_multiple": 2,  # 2×2 latents per token
            "guidance_embeds": bool(config.get("guidance_embeds")),
        }

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        tensors: dict[str, tuple[str | None, tuple[int | str, ...]]] = {
            "hidden_states": (None, ("batch", "patches", self.in_channels)),
            "encoder_hidden_states": (None, ("batch", "tokens", self.cross_attention_dim)),
            "pooled_projections": (None, ("batch", self.pooled_projection_dim)),
            "timestep": ("float32", ("batch",)),
            # Positions feed the rotary embedding, which stays fp32 (as NVIDIA's demo keeps it).
            "img_ids": ("float32", ("patches", 3)),
            "txt_ids": ("float32", ("tokens", 3)),
        }
        if self.guidance_embeds:
            tensors["guidance"] = ("float32", ("batch",))
        return tensors


@dataclass(frozen=True)
class Flux2TransformerSpec(PackedTransformerSpec):
    """FLUX.2: latents patchified 2×2 and packed ``[B, (h/2)(w/2), 4C]``, reference images' tokens after them, with
    positions ``img_ids [patches, 4]`` (t, h, w, l); the LLM's stacked hidden states ``[B, T, joint_attention_dim]``
    with ``txt_ids [T, 4]``; no pooled embedding; ``guidance [B]`` where embedded (klein has none: true CFG, two passes
    at B). The timestep is t / 1000, as Flux2KleinPipeline passes it. The profile's ``references`` (one by default)
    widen the patches' maximum: each reference image, inside the profile's height × width, adds its patches after
    the output's."""

    architecture: ClassVar[str] = "Flux2Transformer2DModel"
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["flux2"]
    token_cap: ClassVar[TokenCap] = klein_token_cap

    guidance_embeds: bool = False

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        # Flux.1's, without a pooled embedding.
        return FluxTransformerSpec.fields_from(config | {"pooled_projection_dim": 0}, vae, vae_scale_factor)

    def default_profile(self) -> ShapeProfile:
        return dataclasses.replace(super().default_profile(), references=1)

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        shapes = super().profile_shapes(profile)
        for t in self.inputs():
            if "patches" in t.shape:
                low, opt, high = shapes[t.name]
                axis = t.shape.index("patches")
                high = (*high[:axis], high[axis] * (1 + profile.references), *high[axis + 1 :])
                shapes[t.name] = (low, opt, high)
        return shapes

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        tensors: dict[str, tuple[str | None, tuple[int | str, ...]]] = {
            "hidden_states": (None, ("batch", "patches", self.in_channels)),
            "encoder_hidden_states": (None, ("batch", "tokens", self.cross_attention_dim)),
            "timestep": ("float32", ("batch",)),
            "img_ids": ("float32", ("patches", 4)),  # positions feed the rotary embedding, which stays fp32
            "txt_ids": ("float32", ("tokens", 4)),
        }
        if self.guidance_embeds:
            tensors["guidance"] = ("float32", ("batch",))
        return tensors


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


@dataclass(frozen=True)
class QwenImageTransformerSpec(PackedTransformerSpec):
    """Qwen-Image: latents packed 2×2 ``[B, (h/2)(w/2), 4C]``, the LLM's last hidden states ``[B, T, 3584]`` with
    their padding mask ``encoder_hidden_states_mask [B, T]`` (int32, 1 a token), the timestep as t / 1000, and the
    rotary embedding's angles as (cos, sin) pairs: ``img_freqs [patches, head/2, 2]``, ``txt_freqs [T, head/2, 2]``
    (fp32). The forward computes them from ``img_shapes``, Python sizes a graph would freeze; the stand-in computes
    them with diffusers' own QwenEmbedRope and the graph rotates by them, as the forward's complex product does."""

    architecture: ClassVar[str] = "QwenImageTransformer2DModel"
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["qwenimage"]
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


TRANSFORMER_KINDS: dict[str, type[TransformerSpec]] = {
    cls.architecture: cls
    for cls in (
        SD3TransformerSpec,
        FluxTransformerSpec,
        Flux2TransformerSpec,
        ZImageTransformerSpec,
        QwenImageTransformerSpec,
    )
}


def _kind(architecture: str) -> type[TransformerSpec]:
    kind = TRANSFORMER_KINDS.get(architecture)
    if kind is None:
        raise ArtifactError(
            f"no graph contract for a {architecture or 'transformer without a class name'}; sdtrt builds "
            f"{', '.join(TRANSFORMER_KINDS)}"
        )
    return kind


def with_reference(sizes: dict[str, int], reference_patches: int) -> dict[str, int]:
    """Axis sizes with a Kontext reference's tokens after the generated ones."""
    return sizes | {axis: sizes[axis] + reference_patches for axis in ("patches", "rope_tokens")}


@functools.cache
def reference_sizes(native_px: int, multiple: int) -> tuple[tuple[int, int], ...]:
    """FLUX.1 Kontext's preferred reference resolutions as (height, width): diffusers' for its 1024 px model (the
    nearest in aspect ratio is what FluxKontextPipeline resizes a reference to), scaled to a model of ``native_px``
    and floored to ``multiple``. Imports diffusers: call it only for a Kontext set."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    def side(px: int) -> int:
        return max(multiple, px * native_px // 1024 // multiple * multiple)

    return tuple((side(h), side(w)) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)  # diffusers lists (width, height)
