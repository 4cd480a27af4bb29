"""Graph contracts: each component's IO, derived from its diffusers/transformers config in one place.

IO names, dtypes, named dynamic axes, sample inputs and TensorRT min/opt/max shapes all come from
here, so export, build, runtimes and validation cannot disagree about them. One spec class per
component — ``unet``, ``text_encoder``, ``vae_decoder``, ``vae_encoder`` — over a shared base that
turns named axes into shapes, profiles and checks.

Axes: ``batch``; ``height``/``width`` in latents; ``image_height``/``image_width`` in pixels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..config import COMPONENTS, Component, IONaming, Precision, Range, ShapeProfile
from ..errors import ArtifactError
from ..families import UNetConditioning

if TYPE_CHECKING:
    import torch

    from ..models import ModelSource

# The pipeline sub-folder each component is loaded from.
FOLDERS: dict[str, str] = {"unet": "unet", "controlnet": "controlnet", "text_encoder": "text_encoder",
                           "text_encoder_2": "text_encoder_2", "vae_decoder": "vae", "vae_encoder": "vae"}  # fmt: skip
NAMED_INPUTS = ("sample", "timestep", "encoder_hidden_states")
NAMED_OUTPUT = "out_sample"
TEXT_TOKENS = 77
Shapes = dict[str, tuple[int, ...]]
S = TypeVar("S", bound="GraphSpec")
AXIS_LABELS = {"batch": "batch", "height": "latent height", "width": "latent width", "image_height": "image height",
               "image_width": "image width"}  # fmt: skip
# ControlNet residuals come at the latent size divided by 2, 4, 8, …: axes "height_2", "width_4", ….
RESIDUAL_SCALES = (2, 4, 8, 16, 32)
for _k in RESIDUAL_SCALES:
    AXIS_LABELS |= {f"height_{_k}": f"latent height / {_k}", f"width_{_k}": f"latent width / {_k}"}


def scaled_axis(axis: str, scale: int) -> str:
    return axis if scale == 1 else f"{axis}_{scale}"


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
class TensorSpec:
    name: str
    dtype: str  # numpy-style name: "float16", "float32", "int32"
    shape: tuple[int | str, ...]  # str = a named dynamic axis

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphSpec:
    """What every component's contract offers; subclasses declare their tensors and axis sizes."""

    component: ClassVar[Component]
    label: ClassVar[str]  # for people: "UNet", "VAE decoder", …
    canonical_inputs: ClassVar[tuple[str, ...]]
    canonical_outputs: ClassVar[tuple[str, ...]]
    # Multiples that dynamic axes must keep (the UNet's down-sampling, the VAE's scale factor).
    grid: ClassVar[dict[str, str]] = {}

    precision: Precision
    io_naming: IONaming
    vae_scale_factor: int

    # ---- what subclasses declare ------------------------------------------------------------

    def inputs(self) -> list[TensorSpec]:
        raise NotImplementedError

    def outputs(self) -> list[TensorSpec]:
        raise NotImplementedError

    def batch_range(self, profile: ShapeProfile) -> Range:
        """This component's batch for a user profile (the UNet's is doubled by guidance)."""
        return profile.batch

    def default_profile(self) -> ShapeProfile:
        raise NotImplementedError

    @property
    def pixel_multiple(self) -> int:
        return self.vae_scale_factor

    # ---- derived ----------------------------------------------------------------------------

    @property
    def input_names(self) -> tuple[str, ...]:
        if self.io_naming == "indexed":
            return tuple(f"input_{i}" for i in range(len(self.canonical_inputs)))
        return self.canonical_inputs

    @property
    def output_names(self) -> tuple[str, ...]:
        if self.io_naming == "indexed":
            return tuple(f"output_{i}" for i in range(len(self.canonical_outputs)))
        return self.canonical_outputs

    @property
    def dtype(self) -> str:
        return "float16" if self.precision == "fp16" else "float32"

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)} for t in self.inputs() + self.outputs()
        }

    def axis_sizes(self, batch: int, height_px: int, width_px: int) -> dict[str, int]:
        f = self.vae_scale_factor
        sizes = {"batch": batch, "height": height_px // f, "width": width_px // f, "image_height": height_px,
                 "image_width": width_px}  # fmt: skip
        return sizes | {scaled_axis(a, k): sizes[a] // k for a in ("height", "width") for k in RESIDUAL_SCALES}

    def input_shapes(self, batch: int, height_px: int, width_px: int) -> Shapes:
        sizes = self.axis_sizes(batch, height_px, width_px)
        return {t.name: tuple(sizes[d] if isinstance(d, str) else d for d in t.shape) for t in self.inputs()}

    def output_shapes(self, input_shapes: Shapes) -> Shapes:
        """Output shapes for these inputs (the runtime allocates outputs before running)."""
        named = {d: s for t in self.inputs() for d, s in zip(t.shape, input_shapes[t.name], strict=True)}
        f = self.vae_scale_factor
        for latent, image in (("height", "image_height"), ("width", "image_width")):
            named.setdefault(image, named.get(latent, 0) * f)
            named.setdefault(latent, named.get(image, 0) // f)
            named |= {scaled_axis(latent, k): named[latent] // k for k in RESIDUAL_SCALES}
        return {t.name: tuple(named[d] if isinstance(d, str) else d for d in t.shape) for t in self.outputs()}

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Per input: (min, opt, max) shapes, as a TensorRT optimization profile wants them."""
        profile.check(self.pixel_multiple)
        batch = self.batch_range(profile)
        corners = [self.input_shapes(batch[i], profile.height[i], profile.width[i]) for i in range(3)]
        return {name: tuple(c[name] for c in corners) for name in self.input_names}

    def check_shapes(self, shapes: Shapes, profile: ShapeProfile | None) -> str | None:
        """Why these input shapes cannot run, or None when they fit (the profile's ranges, if given)."""
        named: dict[str, int] = {}
        for t in self.inputs():
            shape = shapes.get(t.name)
            if shape is None:
                return f"input '{t.name}' is missing"
            if len(shape) != len(t.shape) or any(
                isinstance(d, int) and d != s for d, s in zip(t.shape, shape, strict=True)
            ):
                return f"input '{t.name}' has shape {tuple(shape)}; the engine takes {t.shape}"
            for axis, size in zip(t.shape, shape, strict=True):
                if isinstance(axis, str) and named.setdefault(axis, size) != size:
                    return f"inputs disagree on the {AXIS_LABELS[axis]}: {named[axis]} and {size}"
        for axis, multiple in self.grid.items():
            step = getattr(self, multiple)
            if axis in named and named[axis] % step:
                return f"{AXIS_LABELS[axis]} {named[axis]} must be a multiple of {step}"
        if profile is None:
            return None
        for name, (lo, _, hi) in self.profile_shapes(profile).items():
            shape = shapes[name]
            if any(not a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)):
                return f"input '{name}' has shape {tuple(shape)}, outside the engine's profile {lo} .. {hi}"
        return None

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, dtype: torch.dtype | None = None
    ) -> dict[str, torch.Tensor]:
        """Seeded random inputs: floats in ``dtype`` (default float32) where the graph computes in its dtype,
        float32 where it keeps float32; token ids over the vocabulary."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        shapes = self.input_shapes(batch, height_px, width_px)
        out = {}
        for t in self.inputs():
            if t.dtype.startswith("int"):
                out[t.name] = torch.randint(0, getattr(self, "vocab_size", 2), shapes[t.name], generator=gen).int()
            else:  # inputs the graph keeps fp32 (timestep, conditioning_scale) stay fp32
                wanted = dtype if dtype is not None and t.dtype == self.dtype else torch.float32
                out[t.name] = torch.randn(shapes[t.name], generator=gen).to(wanted)
        return out

    @classmethod
    def from_json(cls: type[S], data: dict[str, Any]) -> S:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (
            {"component": self.component}
            | fields
            | {
                "inputs": [t.to_json() for t in self.inputs()],
                "outputs": [t.to_json() for t in self.outputs()],
            }
        )


@dataclass(frozen=True)
class _DenoiserSpec(GraphSpec):
    """What a UNet and its ControlNet share: latents, timestep, text, the family's conditioning, the grid."""

    grid: ClassVar[dict[str, str]] = {"height": "latent_multiple", "width": "latent_multiple"}

    in_channels: int = 4
    cross_attention_dim: int = 768
    latent_sample_size: int = 64
    latent_multiple: int = 8  # latent H/W must be a multiple: 2 ** (down blocks - 1)
    text_embeds_dim: int = 0  # SDXL's added conditioning (added_cond_kwargs), 0 when absent
    time_ids_dim: int = 0
    timestep_cond_dim: int = 0  # LCM's guidance embedding
    # ControlNet residuals, (channels, downscale) each: the UNet's extra inputs, the ControlNet's outputs.
    residuals: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "residuals", tuple(tuple(r) for r in self.residuals))  # lists from JSON

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
        dtype: torch.dtype | None = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Seeded random inputs shaped like a denoising step's, in ``dtype`` (default: float32)."""
        import torch

        feeds = super().sample_inputs(batch, height_px, width_px, seed=seed, dtype=dtype)
        t_name = self.input_names[1]
        return feeds | {t_name: torch.full_like(feeds[t_name], float(timestep), dtype=torch.float32)}


@dataclass(frozen=True)
class UNetSpec(_DenoiserSpec):
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
        return NAMED_INPUTS + tuple(name for name, _ in self.conditioning_tensors() + self.residual_tensors())

    @property
    def output_name(self) -> str:
        return self.output_names[0]

    def inputs(self) -> list[TensorSpec]:
        extras = self.conditioning_tensors() + self.residual_tensors()
        return self.latent_inputs(self.input_names[:3]) + [
            TensorSpec(name, self.dtype, shape) for name, (_, shape) in zip(self.input_names[3:], extras, strict=True)
        ]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_name, self.dtype, ("batch", self.out_channels, "height", "width"))]


@dataclass(frozen=True)
class ControlNetSpec(_DenoiserSpec):
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


@dataclass(frozen=True)
class TextEncoderSpec(GraphSpec):
    """CLIP text encoders: token ids in; the outputs SD pipelines read (clip_skip 1 included)."""

    component: ClassVar[Component] = "text_encoder"
    label: ClassVar[str] = "text encoder"
    canonical_inputs: ClassVar[tuple[str, ...]] = ("input_ids",)

    hidden_size: int = 768
    pooled_name: str = "pooler_output"  # "text_embeds" for CLIPTextModelWithProjection
    pooled_dim: int = 768
    vocab_size: int = 49408
    max_tokens: int = TEXT_TOKENS

    @classmethod
    def from_config(
        cls, config: dict[str, Any], architecture: str, vae_scale_factor: int, precision: Precision = "fp16",
        io_naming: IONaming = "named",
    ) -> TextEncoderSpec:  # fmt: skip
        projected = architecture == "CLIPTextModelWithProjection"
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=vae_scale_factor,
            hidden_size=config["hidden_size"], pooled_name="text_embeds" if projected else "pooler_output",
            pooled_dim=config["projection_dim"] if projected else config["hidden_size"],
            vocab_size=config["vocab_size"], max_tokens=config.get("max_position_embeddings", TEXT_TOKENS),
        )  # fmt: skip

    @property
    def canonical_outputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("last_hidden_state", self.pooled_name, "penultimate_hidden_state")

    @property
    def pixel_multiple(self) -> int:
        return 1  # no pixels: only the batch of a profile matters here

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.input_names[0], "int32", ("batch", self.max_tokens))]

    def outputs(self) -> list[TensorSpec]:
        hidden, pooled, penultimate = self.output_names
        return [
            TensorSpec(hidden, self.dtype, ("batch", self.max_tokens, self.hidden_size)),
            TensorSpec(pooled, self.dtype, ("batch", self.pooled_dim)),
            TensorSpec(penultimate, self.dtype, ("batch", self.max_tokens, self.hidden_size)),
        ]

    def batch_range(self, profile: ShapeProfile) -> Range:
        return Range(1, 1, profile.batch.max)  # one call per prompt list, positive and negative apart

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile()


@dataclass(frozen=True)
class TextEncoder2Spec(TextEncoderSpec):
    """SDXL's second text encoder (``text_encoder_2``, usually CLIPTextModelWithProjection)."""

    component: ClassVar[Component] = "text_encoder_2"
    label: ClassVar[str] = "second text encoder"


@dataclass(frozen=True)
class _VaeSpec(GraphSpec):
    """What both halves of a VAE know: channels on either side and the native image size."""

    latent_channels: int = 4
    image_channels: int = 3
    native_px: int = 512

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile.around(self.native_px, self.vae_scale_factor)


@dataclass(frozen=True)
class VaeDecoderSpec(_VaeSpec):
    """Latents (already divided by the scaling factor, as pipelines pass them) → images in [-1, 1]."""

    component: ClassVar[Component] = "vae_decoder"
    label: ClassVar[str] = "VAE decoder"
    canonical_inputs: ClassVar[tuple[str, ...]] = ("latent_sample",)
    canonical_outputs: ClassVar[tuple[str, ...]] = ("sample",)

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
    grid: ClassVar[dict[str, str]] = {"image_height": "vae_scale_factor", "image_width": "vae_scale_factor"}

    def inputs(self) -> list[TensorSpec]:
        shape = ("batch", self.image_channels, "image_height", "image_width")
        return [TensorSpec(self.input_names[0], self.dtype, shape)]

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", 2 * self.latent_channels, "height", "width")
        return [TensorSpec(self.output_names[0], self.dtype, shape)]


SPEC_CLASSES: dict[str, type[GraphSpec]] = {
    cls.component: cls
    for cls in (UNetSpec, ControlNetSpec, TextEncoderSpec, TextEncoder2Spec, VaeDecoderSpec, VaeEncoderSpec)
}


def spec_from_json(data: dict[str, Any]) -> GraphSpec:
    """The spec a manifest recorded (manifests from before components existed describe a UNet)."""
    cls = SPEC_CLASSES.get(data.get("component", "unet"))
    if cls is None:
        raise ArtifactError(f"unknown component '{data['component']}' in a manifest; rebuild it with this sdtrt")
    return cls.from_json(data)


def component_spec(
    model: ModelSource, component: Component, precision: Precision = "fp16", io_naming: IONaming = "named"
) -> GraphSpec:
    """The contract of one of the model's networks, from its config."""
    factor = model.vae_scale_factor()
    pooled = model.pooled_text_dim()
    if component == "unet":
        controlnet = model.has("controlnet")
        return UNetSpec.from_config(model.unet_config(), factor, precision, io_naming, pooled, controlnet)
    if component == "controlnet":
        config, size = model.component_config("controlnet"), model.unet_config().get("sample_size")
        return ControlNetSpec.from_config(config, factor, precision, io_naming, pooled, size)
    if component in ("text_encoder", "text_encoder_2"):
        config, (_, architecture) = (
            model.component_config(FOLDERS[component]),
            model.component_class(FOLDERS[component]),
        )
        text_cls = TextEncoderSpec if component == "text_encoder" else TextEncoder2Spec
        return text_cls.from_config(config, architecture, factor, precision, io_naming)
    if component in ("vae_decoder", "vae_encoder"):
        config = model.component_config(FOLDERS[component])
        cls = VaeDecoderSpec if component == "vae_decoder" else VaeEncoderSpec
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=factor,
            latent_channels=config.get("latent_channels", 4),
            image_channels=config.get("out_channels" if component == "vae_decoder" else "in_channels", 3),
            native_px=config.get("sample_size", 512),
        )  # fmt: skip
    raise ArtifactError(f"unknown component '{component}'; sdtrt builds {', '.join(COMPONENTS)}")


def model_components(model: ModelSource) -> tuple[Component, ...]:
    """The components a model has: those with a sub-folder in a pipeline folder, the UNet alone in a bare one."""
    return tuple(c for c in COMPONENTS if c == "unet" or model.has(FOLDERS[c]))
