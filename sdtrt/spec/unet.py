"""The UNet's graph contract (a UNet compiled with an IP-Adapter takes its inputs last: spec/denoiser.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision
from .base import NAMED_INPUTS, NAMED_OUTPUT, ModelConfigs, TensorSpec
from .denoiser import DenoiserSpec, residual_layout


@dataclass(frozen=True)
class UNetSpec(DenoiserSpec):
    """The UNet: sample, timestep, text embeddings, then the family's conditioning and ControlNet residuals."""

    component: ClassVar[Component] = "unet"
    label: ClassVar[str] = "UNet"
    canonical_outputs: ClassVar[tuple[str, ...]] = (NAMED_OUTPUT,)

    out_channels: int = 4

    @classmethod
    def from_config(
        cls, unet_config: dict[str, Any], vae_scale_factor: int, precision: Precision = "fp16",
        io_naming: IONaming = "named", text_embeds_dim: int | None = None, controlnet: bool = False,
    ) -> UNetSpec:  # fmt: skip
        """``controlnet``: the graph takes ControlNet residuals (fed zeros when no ControlNet runs)."""
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=vae_scale_factor,
            out_channels=unet_config.get("out_channels", 4),
            residuals=residual_layout(unet_config) if controlnet else (),
            **cls.config_fields(unet_config, text_embeds_dim),
        )  # fmt: skip

    @property
    def canonical_inputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return NAMED_INPUTS + tuple(name for name, _ in self.extra_tensors())

    @property
    def output_name(self) -> str:
        return self.output_names[0]

    def extra_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        """(canonical name, shape) of the inputs after sample, timestep and text: conditioning, residuals, then the
        IP-Adapter's image embeds (one image) and scales."""
        return self.conditioning_tensors() + self.residual_tensors() + self.ip_adapter_tensors()

    def inputs(self) -> list[TensorSpec]:
        fp32 = self.fixed_inputs()
        tensors = self.latent_inputs(NAMED_INPUTS) + [
            TensorSpec(n, "float32" if n in fp32 else self.dtype, s) for n, s in self.extra_tensors()
        ]
        by_name = {t.name: t for t in tensors}
        return [replace(by_name[c], name=g) for c, g in zip(self.canonical_inputs, self.input_names, strict=True)]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", self.out_channels, "height", "width"))]

    @classmethod
    def for_model(cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> UNetSpec:
        """This component's contract for ``model``, from its configs."""
        factor, pooled, controlnet = model.vae_scale_factor(), model.pooled_text_dim(), model.has("controlnet")
        return cls.from_config(model.unet_config(), factor, precision, io_naming, pooled, controlnet)
