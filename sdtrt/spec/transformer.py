"""Transformer denoisers' graph contracts: SD3 / SD3.5 (MMDiT), Flux.1 and FLUX.2 (DiTs on packed latents); Z-Image's
and Qwen-Image's in their own modules.

Optimum's ``SD3TransformerOnnxConfig`` / ``FluxTransformerOnnxConfig`` and NVIDIA demo/Diffusion's
``model/diffusion_transformer.py`` declare the same IO. Inputs are named as the diffusers forward's
keyword arguments, so the exported wrapper passes them by name.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision, ShapeProfile, TokenCap
from ..core.errors import ArtifactError
from ..core.families import (
    LLM_TOKENS,
    REFERENCE_TOKEN_PIPELINES,
    T5_TOKENS,
    transformer_family,
)
from .base import NAMED_OUTPUT, ModelConfigs, TensorSpec, token_range
from .controlnet_samples import controlnet_sample_names, controlnet_samples
from .denoiser import DenoiserSpec

# FLUX.2 [klein]'s engines (its LLM's and its transformer's) take the pipeline's max_sequence_length default at most.
klein_token_cap = TokenCap(LLM_TOKENS["flux2"], "sdtrt's FLUX.2 [klein] engines take")


# Transformer class name → its kind's contract. Each kind registers itself where it is defined (here, or its family's
# module: transformer_zimage.py, transformer_qwen.py; the spec package imports them all), by its own ``architecture``
# (a step-cache part inherits its kind's and is not registered).
TRANSFORMER_KINDS: dict[str, type[TransformerSpec]] = {}


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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "architecture" in cls.__dict__ and cls.component == "transformer":  # not FLUX.1's ControlNet
            TRANSFORMER_KINDS[cls.architecture] = cls

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> TransformerSpec:
        """This component's contract for ``model``: its latent grid from the transformer's and VAE's configs."""
        config = model.component_config("transformer")
        kind = _kind(config.get("_class_name", ""))
        factor = model.vae_scale_factor()
        vae = model.component_config("vae") if model.has("vae") else {}
        return kind(
            precision=precision, io_naming=io_naming, vae_scale_factor=factor,
            **kind.fields_from(config, vae, factor) | kind.model_fields(model),
            max_sequence_length=T5_TOKENS.get(transformer_family(config), kind.pipeline_tokens),
        )  # fmt: skip

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def model_fields(cls, model: ModelConfigs) -> dict[str, Any]:
        """The fields the rest of the model sets: how its pipeline (model_index.json's class) and its other networks
        call the transformer."""
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


# Flux.1's and FLUX.2's block lists (double-stream, then single-stream), by the config keys that count them.
FLUX_BLOCKS = {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers"}


@dataclass(frozen=True)
class FluxTransformerSpec(PackedTransformerSpec):
    """Flux.1: latents packed 2×2 ``[B, (h/2)(w/2), 64]`` with their positions ``img_ids [(h/2)(w/2), 3]``, T5 tokens
    ``[B, T, 4096]`` with ``txt_ids [T, 3]``, pooled CLIP-L ``[B, 768]``; dev embeds ``guidance [B]``."""

    architecture: ClassVar[str] = "FluxTransformer2DModel"
    pipeline_tokens: ClassVar[int] = 512  # FluxPipeline's, dev's and schnell's alike
    repeated_blocks: ClassVar[dict[str, str]] = FLUX_BLOCKS

    guidance_embeds: bool = True
    # Kontext: the reference image's packed latents follow the generated ones in hidden_states and img_ids (and the
    # output, which the pipeline cuts back); the reference is resized to a preferred resolution (reference_sizes).
    reference_tokens: bool = False
    # A FLUX.1 ControlNet set's: the (double-block, single-block) samples its ControlNet gives, each [B, patches,
    # controlnet_width], inputs the graph adds after its blocks as diffusers' forward does (its samples spread over the
    # blocks); (0, 0): a plain FLUX.1 graph.
    controlnet_samples: tuple[int, int] = (0, 0)
    controlnet_width: int = 0  # the transformer's heads × head size

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "controlnet_samples", tuple(self.controlnet_samples))  # a list from JSON

    @property
    def stamping_problem(self) -> str:
        if any(self.controlnet_samples):
            return "a FLUX.1 ControlNet set's samples are added between its blocks, which stamped copies would skip"
        return ""

    @classmethod
    def model_fields(cls, model: ModelConfigs) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if model.is_pipeline and model.pipeline_class() in REFERENCE_TOKEN_PIPELINES:
            fields["reference_tokens"] = True
        if model.has("controlnet"):  # a FluxControlNetModel (controlnet_samples refuses the kinds it cannot run)
            config = model.component_config("transformer")
            width = config["num_attention_heads"] * config["attention_head_dim"]
            fields |= {"controlnet_samples": controlnet_samples(model.component_config("controlnet")),
                       "controlnet_width": width}  # fmt: skip
        return fields

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
        # Flux's other sets keep the JSON, and so the keys, they had.
        if not self.reference_tokens:
            del data["reference_tokens"]
        if not any(self.controlnet_samples):
            del data["controlnet_samples"], data["controlnet_width"]
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
        samples = controlnet_sample_names(self.controlnet_samples)
        return self.flux_inputs() | {name: (None, ("batch", "patches", self.controlnet_width)) for name in samples}

    def flux_inputs(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        """The inputs FLUX.1's transformer and its ControlNet share."""
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
    repeated_blocks: ClassVar[dict[str, str]] = FLUX_BLOCKS

    guidance_embeds: bool = False

    @classmethod
    def fields_from(cls, config: dict[str, Any], vae: dict[str, Any], vae_scale_factor: int) -> dict[str, Any]:
        # Flux.1's, without a pooled embedding.
        return FluxTransformerSpec.fields_from(config | {"pooled_projection_dim": 0}, vae, vae_scale_factor)

    def default_profile(self) -> ShapeProfile:
        return dataclasses.replace(super().default_profile(), references=1)

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The references' patches on every axis that counts the image's (the step-cache parts' rotary tokens
        too)."""
        shapes = super().profile_shapes(profile)
        patches = self.patches_of(shapes)
        for t in self.inputs():
            low, opt, high = shapes[t.name]
            widened = [size + patches * profile.references if axis in ("patches", "rope_tokens") else size
                       for axis, size in zip(t.shape, high, strict=True)]  # fmt: skip
            shapes[t.name] = (low, opt, tuple(widened))
        return shapes

    def patches_of(self, shapes: dict[str, tuple[tuple[int, ...], ...]]) -> int:
        """The profile's most image patches, read off an input that counts them."""
        t = next(t for t in self.inputs() if "patches" in t.shape)
        return shapes[t.name][2][t.shape.index("patches")]

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
