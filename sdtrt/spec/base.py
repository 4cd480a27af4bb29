"""The contract every component's graph offers: tensors with named axes, shapes, profiles, checks.

One subclass per component kind, one module each (denoiser, unet, controlnet, text_encoder, vae).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from ..core.config import T5_TOKEN_CAP, Component, IONaming, Precision, Range, ShapeProfile, TokenCap

if TYPE_CHECKING:
    from pathlib import Path

    import torch


# The pipeline sub-folder each component is loaded from.
FOLDERS: dict[str, str] = {"unet": "unet", "transformer": "transformer", "controlnet": "controlnet",
                           "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2",
                           "text_encoder_3": "text_encoder_3", "vae_decoder": "vae", "vae_encoder": "vae",
                           "transformer_embed": "transformer", "transformer_first_block": "transformer",
                           "transformer_rest": "transformer", "transformer_out": "transformer",
                           "unet_deep": "unet", "unet_shallow": "unet", "unet_freeu": "unet",
                           "image_encoder": "image_encoder", "vision_encoder": "text_encoder"}  # fmt: skip
NAMED_INPUTS = ("sample", "timestep", "encoder_hidden_states")
NAMED_OUTPUT = "out_sample"
TEXT_TOKENS = 77
Shapes = dict[str, tuple[int, ...]]
S = TypeVar("S", bound="GraphSpec")
AXIS_LABELS = {"batch": "batch", "height": "latent height", "width": "latent width", "image_height": "image height",
               "image_width": "image width", "tokens": "T5 token count", "text_tokens": "CLIP + T5 token count",
               "patches": "latent patch count", "rope_tokens": "token count + latent patch count",
               "vision_patches": "vision tower patch count", "vision_tokens": "vision tower token count"}  # fmt: skip
# ControlNet residuals come at the latent size divided by 2, 4, 8, …: axes "height_2", "width_4", ….
RESIDUAL_SCALES = (2, 4, 8, 16, 32)
for _k in RESIDUAL_SCALES:
    AXIS_LABELS |= {f"height_{_k}": f"latent height / {_k}", f"width_{_k}": f"latent width / {_k}"}


class ModelConfigs(Protocol):
    """What specs read of a model: its folders' configs. models.ModelSource is one; the contract lives here, in
    the core layer, so core code depends on it and not on the model-sources layer above."""

    @property
    def path(self) -> Path: ...  # the model's folder
    @property
    def is_pipeline(self) -> bool: ...  # a pipeline folder (model_index.json), not a bare network's
    def has(self, folder: str) -> bool: ...
    def component_config(self, folder: str) -> dict[str, Any]: ...
    def component_class(self, folder: str) -> tuple[str, str]: ...
    def unet_config(self) -> dict[str, Any]: ...
    def vae_scale_factor(self) -> int: ...
    def pooled_text_dim(self) -> int | None: ...
    def pipeline_class(self) -> str: ...


@dataclass(frozen=True)
class ValidationCase:
    """One seeded input to compare an engine with its network on: the component's batch, pixel size, the
    timestep (denoisers only), the seed and the T5 token count (0: the spec's own, or none)."""

    batch: int
    height: int
    width: int
    timestep: float = 500.0
    seed: int = 0
    tokens: int = 0


def token_range(max_sequence_length: int, pipeline_default: int) -> Range:
    """A default profile's T5 token counts: from a short prompt's, tuned for the family's max_sequence_length, up
    to the pipeline's default one too, so that the pipeline called with its defaults runs on the engines (schnell
    is tuned for 256 tokens, and FluxPipeline passes 512 unless told otherwise)."""
    return Range(min(32, max_sequence_length), max_sequence_length, max(max_sequence_length, pipeline_default))


def scaled_axis(axis: str, scale: int) -> str:
    return axis if scale == 1 else f"{axis}_{scale}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy-style name: "float16", "bfloat16" (ml_dtypes'), "float32", "int32"
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
    # The network class this contract is for, where a component's folder may hold several (T5 or CLIP in
    # text_encoder_2, SD3's or Flux's transformer); "" where the component decides alone.
    architecture: ClassVar[str] = ""
    # Why this network's graph is not fp16 unless asked ("": fp16 is fine); compile builds it as fp16_fallback
    # instead where the target runs that, else fp32.
    fp16_problem: ClassVar[str] = ""
    fp16_fallback: ClassVar[Precision] = "fp32"
    # Whether the image size shapes its inputs (not a text encoder's): labels name a size only where it does.
    reads_pixels: ClassVar[bool] = True
    # The network's lists of identical blocks, by attribute, with the config key that sets each one's length: the
    # streamed export traces a few copies and stamps the rest (graph/onnx_stamp.py), in time that no longer grows
    # with the count. Only lists whose copies after the first are alike (a trace whose copies 1 and 2 differ is
    # refused; tests/test_export_stamped.py proves Flux's at 6+7 blocks).
    repeated_blocks: ClassVar[dict[str, str]] = {}
    # The most text tokens its pipelines take, where a profile has a token axis (T5's for SD3 and FLUX.1).
    token_cap: ClassVar[TokenCap] = T5_TOKEN_CAP

    precision: Precision
    io_naming: IONaming
    vae_scale_factor: int

    # ---- what subclasses declare ------------------------------------------------------------

    @classmethod
    def for_model(cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> GraphSpec:
        """This component's contract for ``model``, from its configs (one place per kind, as Optimum's OnnxConfig)."""
        raise NotImplementedError

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

    @property
    def stamping_problem(self) -> str:
        """Why this graph's repeated blocks must be traced whole although its kind lists them ("": they may be
        stamped)."""
        return ""

    @property
    def stampable_blocks(self) -> dict[str, str]:
        """The repeated_blocks a streamed export may stamp: none where ``stamping_problem`` says why not."""
        return {} if self.stamping_problem else self.repeated_blocks

    # ---- derived ----------------------------------------------------------------------------

    def member_profile(self, profile: ShapeProfile) -> ShapeProfile:
        """This network's profile in an engine set built for ``profile`` (the denoiser's, compile's one): the same,
        except where it reads other text tokens than the denoiser (Qwen-Image's LLM: the template tokens it drops)."""
        return profile

    def check_profile(self, profile: ShapeProfile) -> None:
        """ConfigError unless ``profile`` fits this network: ordered ranges on its pixel grid, and where it reads text
        tokens, no more than its pipelines take (a VAE's member profile may carry the set's tokens)."""
        reads_tokens = self.default_profile().tokens is not None
        profile.check(self.pixel_multiple, self.token_cap if reads_tokens else None)

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
        return {"fp16": "float16", "bf16": "bfloat16"}.get(self.precision, "float32")

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {
            t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)} for t in self.inputs() + self.outputs()
        }

    @property
    def default_tokens(self) -> int:
        """T5's token count when none is asked (its pipelines' max_sequence_length); 0 without T5."""
        return 0

    def token_counts(self, profile: ShapeProfile) -> Range:
        """The profile's T5 token counts where this graph takes them, else zeros (validation labels leave them out)."""
        return profile.tokens if profile.tokens and self.default_tokens else Range(0, 0, 0)

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        f = self.vae_scale_factor
        t = tokens or self.default_tokens
        sizes = {"batch": batch, "height": height_px // f, "width": width_px // f, "image_height": height_px,
                 "image_width": width_px, "tokens": t, "text_tokens": TEXT_TOKENS + t,
                 "patches": (height_px // f // 2) * (width_px // f // 2)}  # fmt: skip
        sizes["rope_tokens"] = sizes["tokens"] + sizes["patches"]
        return sizes | {scaled_axis(a, k): sizes[a] // k for a in ("height", "width") for k in RESIDUAL_SCALES}

    def input_shapes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> Shapes:
        return self.shapes_of(self.axis_sizes(batch, height_px, width_px, tokens))

    def shapes_of(self, sizes: dict[str, int]) -> Shapes:
        """The inputs' shapes, their named axes ``sizes``."""
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
        self.check_profile(profile)
        batch, tokens = self.batch_range(profile), profile.tokens or (0, 0, 0)
        corners = [self.input_shapes(batch[i], profile.height[i], profile.width[i], tokens[i]) for i in range(3)]
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

    def unread_parameters(self, config: Mapping[str, Any], names: Collection[str]) -> frozenset[str]:
        """Of the network's parameters ``names`` (state-dict names; ``config``: its folder's config.json), those no
        output of its graph reads by design, which the exporter drops: check-blocks looks for no initializer of them,
        the weight map lists them as unread (a LoRA on them changes nothing). Here every one is read."""
        return frozenset()

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, dtype: torch.dtype | None = None,
        tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Seeded random inputs: floats in ``dtype`` (default float32) where the graph computes in its dtype,
        float32 where it keeps float32; token ids over the vocabulary."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        shapes = self.input_shapes(batch, height_px, width_px, tokens)
        out = {}
        for t in self.inputs():
            if t.dtype.startswith("int"):
                out[t.name] = torch.randint(0, getattr(self, "vocab_size", 2), shapes[t.name], generator=gen).int()
            else:  # inputs the graph keeps fp32 (timestep, conditioning_scale) stay fp32
                wanted = dtype if dtype is not None and t.dtype == self.dtype else torch.float32
                out[t.name] = torch.randn(shapes[t.name], generator=gen).to(wanted)
        return out

    # ---- validation: the seeded cases validate.py runs for this kind ----------------------------------

    def validation_cases(self, profile: ShapeProfile) -> list[ValidationCase]:
        """The profile's optimum, smallest and largest shapes, one seed each; those of equal inputs once (a text
        encoder's differ by batch and tokens only)."""
        batch, tokens = self.batch_range(profile), self.token_counts(profile)
        cases: dict[tuple[int, ...], ValidationCase] = {}
        for i in (1, 0, 2):
            case = ValidationCase(batch[i], profile.height[i], profile.width[i], seed=2 + i, tokens=tokens[i])
            shape = (case.batch, case.tokens) + ((case.height, case.width) if self.reads_pixels else ())
            cases.setdefault(shape, case)
        return list(cases.values())

    def case_inputs(self, case: ValidationCase) -> dict[str, torch.Tensor]:
        return self.sample_inputs(case.batch, case.height, case.width, seed=case.seed, tokens=case.tokens)

    def case_label(self, case: ValidationCase) -> str:
        size = f" {case.height}x{case.width}" if self.reads_pixels else ""
        return f"b{case.batch}{size}" + (f" T={case.tokens}" if case.tokens else "")

    @classmethod
    def from_json(cls: type[S], data: dict[str, Any]) -> S:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        architecture = {"architecture": self.architecture} if self.architecture else {}  # UNet specs' JSON stays
        return (
            {"component": self.component}
            | architecture
            | fields
            | {
                "inputs": [t.to_json() for t in self.inputs()],
                "outputs": [t.to_json() for t in self.outputs()],
            }
        )
