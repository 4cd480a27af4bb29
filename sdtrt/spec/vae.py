"""The VAE decoder's and encoder's graph contracts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.config import Component, IONaming, Precision, ShapeProfile
from .base import FOLDERS, GraphSpec, ModelConfigs, TensorSpec


@dataclass(frozen=True)
class _VaeSpec(GraphSpec):
    """What both halves of a VAE know: channels on either side and the native image size."""

    image_channels_key: ClassVar[str]

    latent_channels: int = 4
    image_channels: int = 3
    native_px: int = 512

    @classmethod
    def for_model(cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> _VaeSpec:
        """This component's contract for ``model``, from its configs."""
        config = model.component_config(FOLDERS[cls.component])
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=model.vae_scale_factor(),
            latent_channels=config.get("latent_channels", 4), image_channels=config.get(cls.image_channels_key, 3),
            native_px=config.get("sample_size", 512),
        )  # fmt: skip

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

    def inputs(self) -> list[TensorSpec]:
        shape = ("batch", self.image_channels, "image_height", "image_width")
        return [TensorSpec(self.input_names[0], self.dtype, shape)]

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", 2 * self.latent_channels, "height", "width")
        return [TensorSpec(self.output_names[0], self.dtype, shape)]
