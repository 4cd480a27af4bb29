"""The graph contracts of a transformer cut for step caches: embedders | first block | the other blocks | output head.

First-Block Cache, MagCache and TaylorSeer skip blocks between steps, which a monolithic engine cannot do; the
engine set holds the transformer a second time, in these four parts (``sdtrt compile --caches first-block``), and
the stand-in chains them where a cache decides (standins/step_cache.py). Between the parts pass the embedded image
and text tokens ``[B, patches, D]`` / ``[B, tokens, D]`` (D = heads × head size), the conditioning embedding
``temb [B, D]`` and what the kind's blocks take besides (its parts mixin: ``block_extras``): Flux's rotary embedding
``rotary_cos`` / ``rotary_sin [tokens + patches, head size]`` (fp32, as the whole graph keeps it), which the embedders
compute; Qwen-Image's text mask and rotary angles, the whole transformer's own inputs, which the stand-in hands on;
FLUX.2's rotary embedding and its modulations (computed once from temb outside the blocks, as its forward does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.config import Component, IONaming, Precision
from .base import NAMED_OUTPUT, GraphSpec, ModelConfigs, TensorSpec, ValidationCase
from .transformer import (
    Flux2TransformerSpec,
    FluxTransformerSpec,
    PackedTransformerSpec,
    SD3TransformerSpec,
    TransformerSpec,
)
from .transformer_qwen import QwenImageTransformerSpec

if TYPE_CHECKING:
    import torch

Tensors = dict[str, tuple[str | None, tuple[int | str, ...]]]


@dataclass(frozen=True)
class TransformerPartSpec(TransformerSpec):
    """One part of a split transformer, for any kind: a part's class is (part, the kind's parts mixin, the kind)."""

    # A part's graph runs part of a block list (or none of it): nothing to stamp, whatever the kind repeats.
    repeated_blocks: ClassVar[dict[str, str]] = {}
    # The pair a block takes as diffusers' ``image_rotary_emb``, by the part's input names (none: SD3's).
    rotary_pair: ClassVar[tuple[str, ...]] = ()
    # Whether the embedders compute the block extras (Flux's rotary embedding) or the whole transformer takes them.
    embedders_compute_extras: ClassVar[bool] = True
    inner_dim: int = 0  # heads × head size: the width of the tokens between blocks
    head_dim: int = 0  # a head's size: the width of Flux's rotary embedding

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> TransformerPartSpec:
        whole = TransformerSpec.for_model(model, precision, io_naming)
        config = model.component_config("transformer")
        fields = {f.name: getattr(whole, f.name) for f in dataclasses.fields(whole)}
        heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
        part = part_class(cls.component, whole.architecture)
        return part(**fields, inner_dim=heads * head_dim, head_dim=head_dim, **part.kind_fields(config))

    @classmethod
    def kind_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The kind's own part fields, from the transformer's config (FLUX.2's block counts)."""
        return {}

    @property
    def packed(self) -> bool:
        """Whether the transformer returns packed patches (Flux's, Qwen-Image's) rather than a latent image (SD3's)."""
        return isinstance(self, PackedTransformerSpec)

    def whole_inputs(self) -> Tensors:
        """The whole transformer's inputs."""
        return super().input_tensors()

    def block_extras(self) -> Tensors:
        """What a block takes besides the tokens and temb (the kind's parts mixin says)."""
        return {}

    def stream(self) -> Tensors:
        """What a block takes: image and text tokens, temb, and the kind's extras."""
        text_axis = "tokens" if self.packed else "text_tokens"
        tensors: Tensors = {
            "hidden_states": (None, ("batch", "patches", self.inner_dim)),
            "encoder_hidden_states": (None, ("batch", text_axis, self.inner_dim)),
            "temb": (None, ("batch", self.inner_dim)),
        }
        return tensors | self.block_extras()

    def block_inputs(self, first: bool) -> Tensors:
        """What the first block (``first``) or the other blocks read: the stream (an ONNX graph has no unread input,
        and FLUX.2's blocks read their modulations, not temb)."""
        return self.stream()

    def output_tensors(self) -> Tensors:
        raise NotImplementedError

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(name, dtype or self.dtype, shape) for name, (dtype, shape) in self.output_tensors().items()]

    @property
    def canonical_outputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.output_tensors())

    @property
    def output_name(self) -> str:
        return self.output_names[-1]

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, timestep: float = 500.0,
        dtype: torch.dtype | None = None, tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """A step's inputs where the part takes the timestep (the embedders), seeded random tensors elsewhere."""
        if "timestep" in self.canonical_inputs:
            return super().sample_inputs(
                batch, height_px, width_px, seed=seed, timestep=timestep, dtype=dtype, tokens=tokens
            )
        return GraphSpec.sample_inputs(self, batch, height_px, width_px, seed=seed, dtype=dtype, tokens=tokens)

    def case_label(self, case: ValidationCase) -> str:
        label = super().case_label(case)
        return label if "timestep" in self.canonical_inputs else label.rsplit(" t=", 1)[0]


@dataclass(frozen=True)
class EmbedPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_embed"
    label: ClassVar[str] = "transformer's embedders"

    def input_tensors(self) -> Tensors:
        """The whole transformer's inputs, but the extras it hands on to the blocks (an ONNX graph has no unread
        input)."""
        return {name: io for name, io in self.whole_inputs().items() if name not in self.handed_on()}

    def output_tensors(self) -> Tensors:
        computed = {name: io for name, io in self.stream().items() if name not in self.handed_on()}
        return {f"embedded_{name}" if "hidden" in name else name: io for name, io in computed.items()}

    def handed_on(self) -> Tensors:
        """The block extras the stand-in hands on from the whole transformer's inputs (Qwen-Image's), not computed."""
        return {} if self.embedders_compute_extras else self.block_extras()


@dataclass(frozen=True)
class FirstBlockPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_first_block"
    label: ClassVar[str] = "transformer's first block"

    def input_tensors(self) -> Tensors:
        return self.block_inputs(first=True)

    def output_tensors(self) -> Tensors:
        stream = self.stream()
        # diffusers' blocks return (encoder_hidden_states, hidden_states): the same order here.
        return {f"block_{name}": stream[name] for name in ("encoder_hidden_states", "hidden_states")}


@dataclass(frozen=True)
class RestPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_rest"
    label: ClassVar[str] = "transformer's other blocks"

    def input_tensors(self) -> Tensors:
        return self.block_inputs(first=False)

    def output_tensors(self) -> Tensors:
        return {"rest_hidden_states": self.stream()["hidden_states"]}


@dataclass(frozen=True)
class OutPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_out"
    label: ClassVar[str] = "transformer's output head"

    def input_tensors(self) -> Tensors:
        stream = self.stream()
        tensors = {name: stream[name] for name in ("hidden_states", "temb")}
        if not self.packed:  # SD3 folds the patches back into a latent image: the latents' height and width
            tensors["latents"] = self.whole_inputs()["hidden_states"]
        return tensors

    def output_tensors(self) -> Tensors:
        if self.packed:
            return {NAMED_OUTPUT: (None, ("batch", "patches", self.out_channels))}
        return {NAMED_OUTPUT: (None, ("batch", self.out_channels, "height", "width"))}


# ---- what each kind's blocks take besides the tokens and temb ---------------------------------------------------


@dataclass(frozen=True)
class SD3Parts(TransformerPartSpec):
    """SD3's blocks take the tokens and temb alone: positions are added at embedding."""


@dataclass(frozen=True)
class FluxParts(TransformerPartSpec):
    """Flux.1's blocks take the rotary embedding of the text then image positions, which the embedders compute."""

    rotary_pair: ClassVar[tuple[str, ...]] = ("rotary_cos", "rotary_sin")

    def block_extras(self) -> Tensors:
        return {name: ("float32", ("rope_tokens", self.head_dim)) for name in self.rotary_pair}


@dataclass(frozen=True)
class QwenImageParts(TransformerPartSpec):
    """Qwen-Image's blocks take the text mask and the rotary angles: the whole transformer's own inputs, which the
    embedders do not read and the stand-in hands to each block."""

    rotary_pair: ClassVar[tuple[str, ...]] = ("img_freqs", "txt_freqs")
    embedders_compute_extras: ClassVar[bool] = False

    def block_extras(self) -> Tensors:
        whole = self.whole_inputs()
        return {name: whole[name] for name in ("encoder_hidden_states_mask", *self.rotary_pair)}


# FLUX.2's modulations as its blocks take them, by keyword: the double-stream blocks' image and text ones (shift,
# scale and gate for attention and MLP: 6 × D), the single-stream blocks' (3 × D).
FLUX2_DOUBLE_MODULATIONS = ("temb_mod_img", "temb_mod_txt")
FLUX2_SINGLE_MODULATION = "temb_mod"


@dataclass(frozen=True)
class Flux2Parts(TransformerPartSpec):
    """FLUX.2's blocks take the rotary embedding and their modulations, which the embedders compute (its forward
    computes them once from temb, outside the blocks); no block reads temb, which only the output head's norm does."""

    rotary_pair: ClassVar[tuple[str, ...]] = ("rotary_cos", "rotary_sin")
    double_blocks: int = 0  # the config's num_layers: whether the other blocks hold double-stream ones
    single_blocks: int = 0  # num_single_layers

    @classmethod
    def kind_fields(cls, config: dict[str, Any]) -> dict[str, Any]:
        return {"double_blocks": config["num_layers"], "single_blocks": config["num_single_layers"]}

    def block_extras(self) -> Tensors:
        rotary: Tensors = {name: ("float32", ("rope_tokens", self.head_dim)) for name in self.rotary_pair}
        doubles: Tensors = {name: (None, ("batch", 6 * self.inner_dim)) for name in FLUX2_DOUBLE_MODULATIONS}
        return rotary | doubles | {FLUX2_SINGLE_MODULATION: (None, ("batch", 3 * self.inner_dim))}

    def block_inputs(self, first: bool) -> Tensors:
        """The first block is a double-stream one (split_problem refuses a FLUX.2 without); the others read the
        modulations of the kinds of block they hold."""
        doubles, singles = (1, 0) if first else (self.double_blocks - 1, self.single_blocks)
        unread = {"temb"} | (set() if doubles else set(FLUX2_DOUBLE_MODULATIONS))
        unread |= set() if singles else {FLUX2_SINGLE_MODULATION}
        return {name: io for name, io in self.stream().items() if name not in unread}


def _part_kind(
    part: type[TransformerPartSpec], extras: type[TransformerPartSpec], kind: type[TransformerSpec]
) -> type[TransformerPartSpec]:
    """The part's contract for one kind of transformer (``FluxEmbedSpec``, ``SD3OutSpec``, …): the part's class first
    in the bases, so its IO wins; then the kind's block extras; the kind's for the rest (architecture, fields, latent
    layout)."""
    name = kind.__name__.removesuffix("TransformerSpec") + part.__name__.removesuffix("Part") + "Spec"
    bases = (part, extras, kind)
    return dataclass(frozen=True)(type(name, bases, {"__module__": __name__, "__qualname__": name}))


# Each kind a step cache splits, with its block extras.
KINDS: tuple[tuple[type[TransformerSpec], type[TransformerPartSpec]], ...] = (
    (FluxTransformerSpec, FluxParts), (SD3TransformerSpec, SD3Parts), (QwenImageTransformerSpec, QwenImageParts),
    (Flux2TransformerSpec, Flux2Parts),
)  # fmt: skip
PART_CLASSES: tuple[type[TransformerPartSpec], ...] = tuple(
    _part_kind(part, extras, kind) for kind, extras in KINDS for part in (EmbedPart, FirstBlockPart, RestPart, OutPart)
)


def part_class(component: str, architecture: str) -> type[TransformerPartSpec]:
    return next(c for c in PART_CLASSES if c.component == component and c.architecture == architecture)


# The transformer's modules outside its blocks, by the part that holds them (diffusers' attribute names: Flux's and
# SD3's, then Qwen-Image's, then FLUX.2's).
EMBEDDERS = (
    "x_embedder.", "context_embedder.", "time_text_embed.", "pos_embed.", "img_in.", "txt_norm.", "txt_in.",
    "time_guidance_embed.", "double_stream_modulation_img.", "double_stream_modulation_txt.",
    "single_stream_modulation.",
)  # fmt: skip
HEAD = ("norm_out.", "proj_out.")


def part_holds(component: str, module: str) -> bool:
    """Whether the split member ``component`` holds the transformer's ``module`` (a LoRA's target): the embedders,
    the first block (``transformer_blocks.0``), the output head, or every other block."""
    name = f"{module}."
    first = name.startswith("transformer_blocks.0.")
    if component == "transformer_embed":
        return name.startswith(EMBEDDERS)
    if component == "transformer_first_block":
        return first
    if component == "transformer_out":
        return name.startswith(HEAD)
    return not (first or name.startswith(EMBEDDERS + HEAD))


# Why a transformer diffusers' cache hooks could reach is not split (they would be the PyTorch side's reference).
NOT_SPLIT = {
    "ZImageTransformer2DModel": ": diffusers' ZImageTransformer2DModel has no enable_cache, ZImagePipeline opens no "
    "cache context, and First-Block Cache fails on its PyTorch blocks (they take x, not hidden_states)",
}
# The caches a split kind's engines do not run, and why: diffusers' hook fails on its PyTorch transformer (measured
# with diffusers 0.42.1), so no PyTorch pipeline would show what the engines' skipped steps must match.
NO_REFERENCE = {
    ("Flux2Transformer2DModel", "first-block"): "diffusers' First-Block Cache fails on the PyTorch "
    "Flux2Transformer2DModel (unsupported operand type(s) for -: 'Tensor' and 'list': its tail, a single-stream "
    "block, returns the joined stream; diffusers issue 14280), so it has no reference there: use taylorseer",
}


def splits(architecture: str) -> bool:
    """Whether step caches cut a transformer of this class."""
    return any(k.architecture == architecture for k, _ in KINDS)


def reference_problem(architecture: str, cache: str) -> str | None:
    """Why the step cache ``cache`` (first-block, magcache, taylorseer) does not run on this kind's engines, or None."""
    return NO_REFERENCE.get((architecture, cache))


def split_problem(config: dict[str, Any], controlnet: bool = False, caches: tuple[str, ...] = ()) -> str | None:
    """Why this transformer cannot be split for step caches (a kind without parts; one block: nothing to skip; a
    ControlNet's samples, which no part takes; one of ``caches`` the kind's engines do not run), or None."""
    if controlnet:
        return "the step-cache members take no ControlNet block samples yet; compile without --caches"
    kind = config.get("_class_name", "")
    if kind and not splits(kind):
        split = ", ".join(k.architecture for k, _ in KINDS)
        why = NOT_SPLIT.get(kind, "")
        return f"step caches are not built for a {kind}{why} (only for {split}); compile without them"
    if problem := next(filter(None, (reference_problem(kind, cache) for cache in caches)), None):
        return problem
    if kind == Flux2TransformerSpec.architecture and not config.get("num_layers"):
        return "its first block is a single-stream one, and the FLUX.2 split starts with a double-stream block"
    blocks = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    return None if blocks >= 2 else f"it has {blocks} block, and a step cache skips the blocks after the first"
