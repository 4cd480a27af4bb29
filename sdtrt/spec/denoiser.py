"""Denoisers: the graphs a sampler calls each step. A UNet is one kind; a transformer (SD3, Flux) the next.

A denoiser compiled with an IP-Adapter (``sdtrt compile --ip-adapter PATH``) takes two more inputs, last:
``image_embeds``, what diffusers' ``prepare_ip_adapter_image_embeds`` hands the denoiser (the image encoder's embeds;
the adapter's image projection is in the graph), and ``ip_adapter_scale``, one fp32 scale per attention layer the
adapter adds to (``ip_layers``, in ``attn_processors``' order), as ``set_ip_adapter_scale`` sets them. Its spec records
the adapter file's digest, so the graph's key changes with the adapter; a denoiser without one has the JSON (and keys)
it always had.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.config import Range, ShapeProfile
from ..core.families import UNetConditioning
from .base import TEXT_TOKENS, GraphSpec, TensorSpec, ValidationCase, scaled_axis

if TYPE_CHECKING:
    import torch


IMAGE_EMBEDS = "image_embeds"  # what prepare_ip_adapter_image_embeds gives, one adapter's: [batch, 1 image, width]
IP_SCALE = "ip_adapter_scale"  # one fp32 scale per IP-Adapter attention layer


def residual_layout(unet_config: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """(channels, downscale) of each ControlNet residual a UNet takes: one per down-block output, then the mid block's.

    Down blocks yield conv_in's output, one per resnet layer, and one per downsampler (every block but
    the last), as UNet2DConditionModel.forward collects ``down_block_res_samples``.
    """
    channels = list(unet_config["block_out_channels"])
    layers = unet_config.get("layers_per_block", 2)
    layout, scale = [(channels[0], 1)], 1
    for i, width in enumerate(channels):
        per_block = layers if isinstance(layers, int) else layers[i]
        layout += [(width, scale)] * per_block
        if i < len(channels) - 1:
            scale *= 2
            layout.append((width, scale))
    return (*layout, (channels[-1], scale))


def residual_names(count: int) -> tuple[str, ...]:
    """Input (UNet) / output (ControlNet) names of ``count`` residuals: the down blocks', then the mid block's."""
    return (*(f"down_block_res_{i}" for i in range(count - 1)), "mid_block_res") if count else ()


@dataclass(frozen=True)
class DenoiserSpec(GraphSpec):
    """What every denoiser graph shares (a UNet, its ControlNet; next, a transformer): latents, timestep, text,
    the family's conditioning, the grid, and a batch doubled by classifier-free guidance."""

    grid: ClassVar[dict[str, str]] = {"height": "latent_multiple", "width": "latent_multiple"}
    # What the network's timestep input carries for a schedule's timestep t: t itself, or Flux's t / 1000.
    timestep_scale: ClassVar[float] = 1.0

    in_channels: int = 4
    cross_attention_dim: int = 768
    latent_sample_size: int = 64
    latent_multiple: int = 8  # latent H/W must be a multiple: 2 ** (down blocks - 1)
    text_embeds_dim: int = 0  # SDXL's added conditioning (added_cond_kwargs), 0 when absent
    time_ids_dim: int = 0
    timestep_cond_dim: int = 0  # LCM's guidance embedding
    # ControlNet residuals, (channels, downscale) each: the UNet's extra inputs, the ControlNet's outputs.
    residuals: tuple[tuple[int, int], ...] = ()
    # The IP-Adapter the graph was exported with (0, (), "": none): its image embeds' width, the attention layers it
    # adds to, and its weight file's sha256.
    image_embeds_dim: int = 0
    ip_layers: tuple[str, ...] = ()
    ip_adapter_digest: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "residuals", tuple(tuple(r) for r in self.residuals))  # lists from JSON
        object.__setattr__(self, "ip_layers", tuple(self.ip_layers))

    def ip_adapter_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        """(canonical name, shape) of the IP-Adapter's inputs, the graph's last: the image embeds (one image) and
        one scale per layer it adds to."""
        if not self.image_embeds_dim:
            return []
        return [(IMAGE_EMBEDS, ("batch", 1, self.image_embeds_dim)), (IP_SCALE, (len(self.ip_layers),))]

    def fixed_inputs(self) -> dict[str, tuple[float, ...]]:
        """Inputs that stay fp32 whatever the graph's precision (the IP-Adapter's scales, Python floats in diffusers),
        by canonical name, with the values validation feeds them: the scales load_ip_adapter sets, so the graph is
        checked where it is used."""
        return {IP_SCALE: (1.0,) * len(self.ip_layers)} if self.image_embeds_dim else {}

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        if not self.image_embeds_dim:  # a denoiser without an IP-Adapter keeps the JSON, and so the keys, it had
            for name in ("image_embeds_dim", "ip_layers", "ip_adapter_digest"):
                del data[name]
        return data

    @classmethod
    def config_fields(
        cls, config: dict[str, Any], text_embeds_dim: int | None, sample_size: int | list[int] | None = None
    ) -> dict[str, Any]:
        """The fields a UNet or ControlNet config gives (a ControlNet has no sample_size: its UNet's is passed)."""
        conditioning = UNetConditioning.of(config, text_embeds_dim)
        size = sample_size or config.get("sample_size", 64)
        return {
            "in_channels": config.get("in_channels", 4),
            "cross_attention_dim": config["cross_attention_dim"],
            "latent_sample_size": size if isinstance(size, int) else size[0],
            "latent_multiple": 2 ** (len(config["down_block_types"]) - 1),
            "text_embeds_dim": conditioning.text_embeds_dim,
            "time_ids_dim": conditioning.time_ids_dim,
            "timestep_cond_dim": conditioning.timestep_cond_dim,
        }

    def conditioning_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        """(canonical name, shape) of the family's conditioning inputs: SDXL's, then LCM's."""
        sizes = (("text_embeds", self.text_embeds_dim), ("time_ids", self.time_ids_dim),
                 ("timestep_cond", self.timestep_cond_dim))  # fmt: skip
        return [(name, ("batch", size)) for name, size in sizes if size]

    def residual_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        names = residual_names(len(self.residuals))
        return [
            (name, ("batch", channels, scaled_axis("height", k), scaled_axis("width", k)))
            for name, (channels, k) in zip(names, self.residuals, strict=True)
        ]

    def latent_inputs(self, names: tuple[str, ...]) -> list[TensorSpec]:
        sample, timestep, text = names
        return [
            TensorSpec(sample, self.dtype, ("batch", self.in_channels, "height", "width")),
            TensorSpec(timestep, "float32", ("batch",)),  # the timestep stays fp32 in fp16 graphs
            TensorSpec(text, self.dtype, ("batch", TEXT_TOKENS, self.cross_attention_dim)),
        ]

    @property
    def pixel_multiple(self) -> int:
        return self.latent_multiple * self.vae_scale_factor

    def batch_range(self, profile: ShapeProfile) -> Range:
        return profile.unet_batch()

    def default_profile(self) -> ShapeProfile:
        profile = ShapeProfile.around(self.latent_sample_size * self.vae_scale_factor, self.pixel_multiple)
        # LCM embeds the guidance scale (timestep_cond) instead of running the UNet twice.
        return dataclasses.replace(profile, guidance=not self.timestep_cond_dim)

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, timestep: float = 500.0,
        dtype: torch.dtype | None = None, tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Seeded random inputs shaped like a denoising step's, in ``dtype`` (default: float32)."""
        import torch

        feeds = super().sample_inputs(batch, height_px, width_px, seed=seed, dtype=dtype, tokens=tokens)
        t_name = self.input_names[self.canonical_inputs.index("timestep")]
        value = float(timestep) * self.timestep_scale
        for name, values in self.fixed_inputs().items():
            feeds[self.input_names[self.canonical_inputs.index(name)]] = torch.tensor(values, dtype=torch.float32)
        return feeds | {t_name: torch.full_like(feeds[t_name], value, dtype=torch.float32)}

    def validation_cases(self, profile: ShapeProfile) -> list[ValidationCase]:
        """Timesteps across the schedule at the optimum shape, plus the profile's smallest and largest."""
        batch, tokens = self.batch_range(profile), self.token_counts(profile)
        opt = (batch.opt, profile.height.opt, profile.width.opt)
        return [
            ValidationCase(*opt, timestep=999.0, seed=0, tokens=tokens.opt),
            ValidationCase(*opt, timestep=500.0, seed=1, tokens=tokens.opt),
            ValidationCase(*opt, timestep=1.0, seed=2, tokens=tokens.opt),
            ValidationCase(batch.min, profile.height.min, profile.width.min, timestep=750.0, seed=3, tokens=tokens.min),
            ValidationCase(batch.max, profile.height.max, profile.width.max, timestep=250.0, seed=4, tokens=tokens.max),
        ]

    def case_inputs(self, case: ValidationCase) -> dict[str, torch.Tensor]:
        return self.sample_inputs(
            case.batch, case.height, case.width, seed=case.seed, timestep=case.timestep, tokens=case.tokens
        )

    def case_label(self, case: ValidationCase) -> str:
        return f"{super().case_label(case)} t={case.timestep:g}"
