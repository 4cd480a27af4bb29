"""A ControlNet's graph contract: a denoiser helper whose outputs are the UNet's residual inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision
from .base import NAMED_INPUTS, ModelConfigs, TensorSpec
from .denoiser import DenoiserSpec, residual_layout


@dataclass(frozen=True)
class ControlNetSpec(DenoiserSpec):
    """A ControlNet: the UNet's inputs plus the control image and its scale → the residuals the UNet adds."""

    component: ClassVar[Component] = "controlnet"
    label: ClassVar[str] = "ControlNet"

    conditioning_channels: int = 3

    @classmethod
    def from_config(
        cls, config: dict[str, Any], vae_scale_factor: int, precision: Precision = "fp16",
        io_naming: IONaming = "named", text_embeds_dim: int | None = None, sample_size: int | None = None,
    ) -> ControlNetSpec:  # fmt: skip
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=vae_scale_factor,
            conditioning_channels=config.get("conditioning_channels", 3), residuals=residual_layout(config),
            **cls.config_fields(config, text_embeds_dim, sample_size),
        )  # fmt: skip

    @property
    def canonical_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        conditioning = tuple(name for name, _ in self.conditioning_tensors())
        return (*NAMED_INPUTS, "controlnet_cond", "conditioning_scale", *conditioning)

    @property
    def canonical_outputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(name for name, _ in self.residual_tensors())

    def inputs(self) -> list[TensorSpec]:
        names = self.input_names
        image = ("batch", self.conditioning_channels, "image_height", "image_width")
        return self.latent_inputs(names[:3]) + [
            TensorSpec(names[3], self.dtype, image),
            TensorSpec(names[4], "float32", (1,)),  # one scale per ControlNet call
        ] + [
            TensorSpec(name, self.dtype, shape)
            for name, (_, shape) in zip(names[5:], self.conditioning_tensors(), strict=True)
        ]  # fmt: skip

    def outputs(self) -> list[TensorSpec]:
        return [
            TensorSpec(name, self.dtype, shape)
            for name, (_, shape) in zip(self.output_names, self.residual_tensors(), strict=True)
        ]

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> ControlNetSpec:
        """This component's contract for ``model``, from its configs."""
        config, size = model.component_config("controlnet"), model.unet_config().get("sample_size")
        return cls.from_config(config, model.vae_scale_factor(), precision, io_naming, model.pooled_text_dim(), size)
