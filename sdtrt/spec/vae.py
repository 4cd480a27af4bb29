"""The VAE decoder's and encoder's graph contracts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision, ShapeProfile
from ..core.families import QWEN_IMAGE_EDIT_PIPELINES, REFERENCE_TOKEN_PIPELINES
from .base import FOLDERS, GraphSpec, ModelConfigs, TensorSpec
from .qwen_vision import edit_condition_sizes
from .transformer import reference_sizes

# Video VAEs whose pipelines run them on one frame.
SINGLE_FRAME_VAES = ("AutoencoderKLQwenImage",)


@dataclass(frozen=True)
class _VaeSpec(GraphSpec):
    """What both halves of a VAE know: channels on either side and the native image size. ``single_frame``: a video
    VAE used on images (Qwen-Image's AutoencoderKLQwenImage, latents ``[B, C, frames, h, w]``): the graph is its
    encode / decode at one frame, the frame axis taken out of its inputs and outputs (the stand-in puts it back)."""

    image_channels_key: ClassVar[str]

    latent_channels: int = 4
    image_channels: int = 3
    native_px: int = 512
    single_frame: bool = False

    @classmethod
    def for_model(cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> _VaeSpec:
        """This component's contract for ``model``, from its configs."""
        config = model.component_config(FOLDERS[cls.component])
        frames = config.get("_class_name") in SINGLE_FRAME_VAES
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=model.vae_scale_factor(),
            latent_channels=config.get("latent_channels") or config.get("z_dim", 4),
            image_channels=config.get(cls.image_channels_key, 3),
            native_px=config.get("sample_size", 1024 if frames else 512),  # QwenImagePipeline: 1024 px
            single_frame=frames,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.single_frame:  # the other sets keep the JSON, and so the keys, they had
            del data["single_frame"]
        return data

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile.around(self.native_px, self.vae_scale_factor)


@dataclass(frozen=True)
class VaeDecoderSpec(_VaeSpec):
    """Latents (already divided by the scaling factor, as pipelines pass them) → images in [-1, 1]."""

    component: ClassVar[Component] = "vae_decoder"
    label: ClassVar[str] = "VAE decoder"
    canonical_inputs: ClassVar[tuple[str, ...]] = ("latent_sample",)
    canonical_outputs: ClassVar[tuple[str, ...]] = ("sample",)
    image_channels_key: ClassVar[str] = "out_channels"  # the config key of the image side's channels

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.input_names[0], self.dtype, ("batch", self.latent_channels, "height", "width"))]

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", self.image_channels, "image_height", "image_width")
        return [TensorSpec(self.output_names[0], self.dtype, shape)]


@dataclass(frozen=True)
class VaeEncoderSpec(_VaeSpec):
    """Images in [-1, 1] → the latent distribution's parameters (mean and log-variance, stacked)."""

    component: ClassVar[Component] = "vae_encoder"
    label: ClassVar[str] = "VAE encoder"
    canonical_inputs: ClassVar[tuple[str, ...]] = ("sample",)
    canonical_outputs: ClassVar[tuple[str, ...]] = ("latent_parameters",)
    image_channels_key: ClassVar[str] = "in_channels"
    grid: ClassVar[dict[str, str]] = {"image_height": "vae_scale_factor", "image_width": "vae_scale_factor"}

    # The sides of the other images it encodes, 0 for none: FLUX.1 Kontext's references (their preferred resolutions),
    # Qwen-Image-Edit's condition image.
    reference_min_px: int = 0
    reference_max_px: int = 0

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> VaeEncoderSpec:
        spec = super().for_model(model, precision, io_naming)
        assert isinstance(spec, VaeEncoderSpec)
        pipeline = model.pipeline_class() if model.is_pipeline else ""
        if pipeline in QWEN_IMAGE_EDIT_PIPELINES:  # its ~1024² condition image, whatever the output's size
            sides = [side for size in edit_condition_sizes() for side in size]
        elif pipeline in REFERENCE_TOKEN_PIPELINES:
            sides = [side for size in reference_sizes(spec.native_px, 2 * spec.vae_scale_factor) for side in size]
        else:
            return spec
        return dataclasses.replace(spec, reference_min_px=min(sides), reference_max_px=max(sides))

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Images of the output's sizes and, for Kontext, its references' (672x1568 and 1568x672 at 1024 px), for
        Qwen-Image-Edit its condition image's."""
        shapes = super().profile_shapes(profile)
        if not self.reference_max_px:
            return shapes
        ((name, (low, opt, high)),) = shapes.items()
        low = low[:2] + tuple(min(side, self.reference_min_px) for side in low[2:])
        high = high[:2] + tuple(max(side, self.reference_max_px) for side in high[2:])
        return {name: (low, opt, high)}

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.reference_max_px:  # the other sets keep the JSON, and so the keys, they had
            del data["reference_min_px"], data["reference_max_px"]
        return data

    def inputs(self) -> list[TensorSpec]:
        shape = ("batch", self.image_channels, "image_height", "image_width")
        return [TensorSpec(self.input_names[0], self.dtype, shape)]

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", 2 * self.latent_channels, "height", "width")
        return [TensorSpec(self.output_names[0], self.dtype, shape)]
