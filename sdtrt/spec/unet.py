"""The UNet's graph contract.

A UNet compiled with an IP-Adapter (``sdtrt compile --ip-adapter PATH``) takes two more inputs: ``image_embeds``, what
diffusers' ``prepare_ip_adapter_image_embeds`` hands the UNet (the image encoder's embeds, the negative's zeros first;
the adapter's image projection is in the graph), and ``ip_adapter_scale``, one fp32 scale per attention layer the
adapter adds to (``ip_layers``, in ``unet.attn_processors``' order), as ``set_ip_adapter_scale`` sets them. Its spec
records the adapter file's digest, so the graph's key changes with the adapter; a UNet without one has the JSON (and
keys) it always had.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.config import Component, IONaming, Precision
from .base import NAMED_INPUTS, NAMED_OUTPUT, ModelConfigs, TensorSpec
from .denoiser import DenoiserSpec, residual_layout

if TYPE_CHECKING:
    import torch

IMAGE_EMBEDS = "image_embeds"  # added_cond_kwargs["image_embeds"][0]: [batch, 1 image, width]
IP_SCALE = "ip_adapter_scale"  # one fp32 scale per IP-Adapter attention layer


@dataclass(frozen=True)
class UNetSpec(DenoiserSpec):
    """The UNet: sample, timestep, text embeddings, then the family's conditioning and ControlNet residuals."""

    component: ClassVar[Component] = "unet"
    label: ClassVar[str] = "UNet"
    canonical_outputs: ClassVar[tuple[str, ...]] = (NAMED_OUTPUT,)

    out_channels: int = 4
    # The IP-Adapter the graph was exported with (0, (), "": none): its image embeds' width, the attention layers it
    # adds to, and its weight file's sha256.
    image_embeds_dim: int = 0
    ip_layers: tuple[str, ...] = ()
    ip_adapter_digest: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ip_layers", tuple(self.ip_layers))  # a list from JSON

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

    def ip_adapter_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        if not self.image_embeds_dim:
            return []
        return [(IMAGE_EMBEDS, ("batch", 1, self.image_embeds_dim)), (IP_SCALE, (len(self.ip_layers),))]

    def fixed_inputs(self) -> dict[str, tuple[float, ...]]:
        """Inputs that stay fp32 whatever the graph's precision (the IP-Adapter's scales, Python floats in diffusers),
        by canonical name, with the values validation feeds them: the scales load_ip_adapter sets, so the graph is
        checked where it is used."""
        return {IP_SCALE: (1.0,) * len(self.ip_layers)} if self.image_embeds_dim else {}

    def inputs(self) -> list[TensorSpec]:
        fp32 = self.fixed_inputs()
        tensors = self.latent_inputs(NAMED_INPUTS) + [
            TensorSpec(n, "float32" if n in fp32 else self.dtype, s) for n, s in self.extra_tensors()
        ]
        by_name = {t.name: t for t in tensors}
        return [replace(by_name[c], name=g) for c, g in zip(self.canonical_inputs, self.input_names, strict=True)]

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, timestep: float = 500.0,
        dtype: torch.dtype | None = None, tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        import torch

        feeds = super().sample_inputs(
            batch, height_px, width_px, seed=seed, timestep=timestep, dtype=dtype, tokens=tokens
        )
        for name, values in self.fixed_inputs().items():
            feeds[self.input_names[self.canonical_inputs.index(name)]] = torch.tensor(values, dtype=torch.float32)
        return feeds

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.image_embeds_dim:  # a UNet without an IP-Adapter keeps the JSON, and so the keys, it had
            for name in ("image_embeds_dim", "ip_layers", "ip_adapter_digest"):
                del data[name]
        return data

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", self.out_channels, "height", "width"))]

    @classmethod
    def for_model(cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> UNetSpec:
        """This component's contract for ``model``, from its configs."""
        factor, pooled, controlnet = model.vae_scale_factor(), model.pooled_text_dim(), model.has("controlnet")
        return cls.from_config(model.unet_config(), factor, precision, io_naming, pooled, controlnet)
