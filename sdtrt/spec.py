"""UNetSpec: everything about the UNet graph's interface, derived from ``unet.config`` in one place.

IO names, dtypes, dynamic axes, sample inputs and TensorRT min/opt/max shapes all come from here, so
export, build, runtimes and validation cannot disagree about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import IONaming, Precision, ShapeProfile
from .models import check_supported_unet

if TYPE_CHECKING:
    import torch

NAMED_INPUTS = ("sample", "timestep", "encoder_hidden_states")
NAMED_OUTPUT = "out_sample"
TEXT_TOKENS = 77


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy-style name: "float16", "float32"
    shape: tuple[int | str, ...]  # str = a named dynamic axis

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class UNetSpec:
    in_channels: int
    out_channels: int
    cross_attention_dim: int
    latent_sample_size: int
    latent_multiple: int  # latent H/W must be a multiple: 2 ** (down blocks - 1)
    vae_scale_factor: int
    precision: Precision = "fp16"
    io_naming: IONaming = "named"

    @classmethod
    def from_config(
        cls, unet_config: dict[str, Any], vae_scale_factor: int, precision: Precision = "fp16",
        io_naming: IONaming = "named",
    ) -> UNetSpec:  # fmt: skip
        check_supported_unet(unet_config)
        sample_size = unet_config.get("sample_size", 64)
        return cls(
            in_channels=unet_config.get("in_channels", 4),
            out_channels=unet_config.get("out_channels", 4),
            cross_attention_dim=unet_config["cross_attention_dim"],
            latent_sample_size=sample_size if isinstance(sample_size, int) else sample_size[0],
            latent_multiple=2 ** (len(unet_config["down_block_types"]) - 1),
            vae_scale_factor=vae_scale_factor,
            precision=precision,
            io_naming=io_naming,
        )

    # ---- names and types --------------------------------------------------------------------

    @property
    def input_names(self) -> tuple[str, str, str]:
        if self.io_naming == "indexed":
            return ("input_0", "input_1", "input_2")
        return NAMED_INPUTS

    @property
    def output_name(self) -> str:
        return "output_0" if self.io_naming == "indexed" else NAMED_OUTPUT

    @property
    def dtype(self) -> str:
        return "float16" if self.precision == "fp16" else "float32"

    @property
    def pixel_multiple(self) -> int:
        return self.latent_multiple * self.vae_scale_factor

    def inputs(self) -> list[TensorSpec]:
        sample, timestep, text = self.input_names
        return [
            TensorSpec(sample, self.dtype, ("batch", self.in_channels, "height", "width")),
            TensorSpec(timestep, "float32", ("batch",)),  # the timestep stays fp32 in fp16 graphs
            TensorSpec(text, self.dtype, ("batch", TEXT_TOKENS, self.cross_attention_dim)),
        ]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", self.out_channels, "height", "width"))]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)} for t in self.inputs() + self.outputs()
        }

    # ---- shapes -----------------------------------------------------------------------------

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile.around(self.latent_sample_size * self.vae_scale_factor, self.pixel_multiple)

    def input_shapes(self, unet_batch: int, height_px: int, width_px: int) -> dict[str, tuple[int, ...]]:
        sample, timestep, text = self.input_names
        h, w = height_px // self.vae_scale_factor, width_px // self.vae_scale_factor
        return {
            sample: (unet_batch, self.in_channels, h, w),
            timestep: (unet_batch,),
            text: (unet_batch, TEXT_TOKENS, self.cross_attention_dim),
        }

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Per input: (min, opt, max) shapes, as a TensorRT optimization profile wants them."""
        profile.check(self.pixel_multiple)
        batch = profile.unet_batch()
        corners = [self.input_shapes(batch[i], profile.height[i], profile.width[i]) for i in range(3)]
        return {name: tuple(c[name] for c in corners) for name in self.input_names}

    def check_shapes(self, shapes: dict[str, tuple[int, ...]], profile: ShapeProfile | None) -> str | None:
        """Why these input shapes cannot run, or None when they fit (the profile's ranges, if given)."""
        for t in self.inputs():
            shape = shapes.get(t.name)
            if shape is None:
                return f"input '{t.name}' is missing"
            if len(shape) != len(t.shape) or any(
                isinstance(d, int) and d != s for d, s in zip(t.shape, shape, strict=True)
            ):
                return f"input '{t.name}' has shape {tuple(shape)}; the engine takes {t.shape}"
        sample_shape = shapes[self.input_names[0]]
        if len({shapes[name][0] for name in self.input_names}) != 1:
            return f"inputs disagree on the batch size: {[shapes[n][0] for n in self.input_names]}"
        if any(d % self.latent_multiple for d in sample_shape[2:]):
            return f"latent height/width {tuple(sample_shape[2:])} must be multiples of {self.latent_multiple}"
        if profile is None:
            return None
        for name, (lo, _, hi) in self.profile_shapes(profile).items():
            shape = shapes[name]
            if any(not a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)):
                return f"input '{name}' has shape {tuple(shape)}, outside the engine's profile {lo} .. {hi}"
        return None

    def sample_inputs(
        self, unet_batch: int, height_px: int, width_px: int, *, seed: int = 0, timestep: float = 500.0,
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Seeded random inputs shaped like a denoising step's, in ``dtype`` (default: float32)."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        shapes = self.input_shapes(unet_batch, height_px, width_px)
        sample, t_name, text = self.input_names
        dtype = dtype or torch.float32
        return {
            sample: torch.randn(shapes[sample], generator=gen).to(dtype),
            t_name: torch.full(shapes[t_name], float(timestep), dtype=torch.float32),
            text: torch.randn(shapes[text], generator=gen).to(dtype),
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [t.to_json() for t in self.inputs()],
            "outputs": [t.to_json() for t in self.outputs()],
            "latent_multiple": self.latent_multiple,
            "vae_scale_factor": self.vae_scale_factor,
            "latent_sample_size": self.latent_sample_size,
            "cross_attention_dim": self.cross_attention_dim,
            "in_channels": self.in_channels,
            "out_channels": self.out_channels,
            "precision": self.precision,
            "io_naming": self.io_naming,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UNetSpec:
        keys = ("in_channels", "out_channels", "cross_attention_dim", "latent_sample_size", "latent_multiple",
                "vae_scale_factor", "precision", "io_naming")  # fmt: skip
        return cls(**{k: data[k] for k in keys})
