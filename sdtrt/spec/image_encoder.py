"""An IP-Adapter's image encoder's graph contract: CLIPVisionModelWithProjection, as diffusers' ``encode_image`` calls
it for the plain IP-Adapter (the feature extractor's pixels in, the projected ``image_embeds`` out).

The encoder comes with the adapter (its ``image_encoder/`` folder), not with the model, so its contract is made from
the adapter's config (``from_config``), never from a model folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision, Range, ShapeProfile
from ..core.errors import ConfigError
from .base import GraphSpec, ModelConfigs, TensorSpec


@dataclass(frozen=True)
class ImageEncoderSpec(GraphSpec):
    """``pixel_values [B, channels, size, size]`` → ``image_embeds [B, projection_dim]``."""

    component: ClassVar[Component] = "image_encoder"
    label: ClassVar[str] = "IP-Adapter image encoder"
    reads_pixels: ClassVar[bool] = False  # its pixels are the feature extractor's fixed size, not the image's
    canonical_inputs: ClassVar[tuple[str, ...]] = ("pixel_values",)
    canonical_outputs: ClassVar[tuple[str, ...]] = ("image_embeds",)

    channels: int = 3
    image_size: int = 224
    projection_dim: int = 1024

    @classmethod
    def from_config(
        cls, config: dict[str, Any], precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> ImageEncoderSpec:
        """From the adapter's image_encoder/config.json (a CLIPVisionConfig)."""
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=1, channels=config.get("num_channels", 3),
            image_size=config["image_size"], projection_dim=config["projection_dim"],
        )  # fmt: skip

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> ImageEncoderSpec:
        raise ConfigError("an image encoder comes with an IP-Adapter, not the model: ExportConfig(ip_adapter=PATH)")

    @property
    def pixel_multiple(self) -> int:
        return 1  # a fixed size: only the batch of a profile matters here

    def inputs(self) -> list[TensorSpec]:
        shape = ("batch", self.channels, self.image_size, self.image_size)
        return [TensorSpec(self.input_names[0], self.dtype, shape)]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_names[0], self.dtype, ("batch", self.projection_dim))]

    def batch_range(self, profile: ShapeProfile) -> Range:
        return Range(1, 1, profile.batch.max)  # one IP image per call, or one per prompt

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile()
