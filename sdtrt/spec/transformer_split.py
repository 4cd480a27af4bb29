"""The graph contracts of a transformer cut for step caches: embedders | first block | the other blocks | output head.

First-Block Cache, MagCache and TaylorSeer skip blocks between steps, which a monolithic engine cannot do; the
engine set holds the transformer a second time, in these four parts (``sdtrt compile --caches first-block``), and
the stand-in chains them where a cache decides (standins/step_cache.py). Between the parts pass the embedded image
and text tokens ``[B, patches, D]`` / ``[B, tokens, D]`` (D = heads × head size), the conditioning embedding
``temb [B, D]`` and, for Flux, the rotary embedding ``rotary_cos`` / ``rotary_sin [tokens + patches, head size]``
(fp32, as the whole graph keeps it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..core.config import Component, IONaming, Precision
from .base import NAMED_OUTPUT, GraphSpec, ModelConfigs, TensorSpec, ValidationCase
from .transformer import FluxTransformerSpec, SD3TransformerSpec, TransformerSpec

if TYPE_CHECKING:
    import torch

Tensors = dict[str, tuple[str | None, tuple[int | str, ...]]]


@dataclass(frozen=True)
class TransformerPartSpec(TransformerSpec):
    """One part of a split transformer, for either kind (the kind's class comes second in a part's bases)."""

    # A part's graph runs part of a block list (or none of it): nothing to stamp, whatever the kind repeats.
    repeated_blocks: ClassVar[dict[str, str]] = {}
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
        return part_class(cls.component, whole.architecture)(**fields, inner_dim=heads * head_dim, head_dim=head_dim)

    @property
    def rotary(self) -> bool:
        """Whether the blocks take a rotary embedding (Flux) rather than positions added at embedding (SD3)."""
        return isinstance(self, FluxTransformerSpec)

    def whole_inputs(self) -> Tensors:
        """The whole transformer's inputs."""
        return super().input_tensors()

    def stream(self) -> Tensors:
        """What a block takes: image and text tokens, temb, and Flux's rotary embedding."""
        text_axis = "tokens" if self.rotary else "text_tokens"
        tensors: Tensors = {
            "hidden_states": (None, ("batch", "patches", self.inner_dim)),
            "encoder_hidden_states": (None, ("batch", text_axis, self.inner_dim)),
            "temb": (None, ("batch", self.inner_dim)),
        }
        if self.rotary:
            tensors |= {name: ("float32", ("rope_tokens", self.head_dim)) for name in ("rotary_cos", "rotary_sin")}
        return tensors

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
        return self.whole_inputs()

    def output_tensors(self) -> Tensors:
        return {f"embedded_{name}" if "hidden" in name else name: io for name, io in self.stream().items()}


@dataclass(frozen=True)
class FirstBlockPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_first_block"
    label: ClassVar[str] = "transformer's first block"

    def input_tensors(self) -> Tensors:
        return self.stream()

    def output_tensors(self) -> Tensors:
        stream = self.stream()
        # diffusers' blocks return (encoder_hidden_states, hidden_states): the same order here.
        return {f"block_{name}": stream[name] for name in ("encoder_hidden_states", "hidden_states")}


@dataclass(frozen=True)
class RestPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_rest"
    label: ClassVar[str] = "transformer's other blocks"

    def input_tensors(self) -> Tensors:
        return self.stream()

    def output_tensors(self) -> Tensors:
        return {"rest_hidden_states": self.stream()["hidden_states"]}


@dataclass(frozen=True)
class OutPart(TransformerPartSpec):
    component: ClassVar[Component] = "transformer_out"
    label: ClassVar[str] = "transformer's output head"

    def input_tensors(self) -> Tensors:
        stream = self.stream()
        tensors = {name: stream[name] for name in ("hidden_states", "temb")}
        if not self.rotary:  # SD3 folds the patches back into a latent image: the latents' height and width
            tensors["latents"] = self.whole_inputs()["hidden_states"]
        return tensors

    def output_tensors(self) -> Tensors:
        if self.rotary:
            return {NAMED_OUTPUT: (None, ("batch", "patches", self.out_channels))}
        return {NAMED_OUTPUT: (None, ("batch", self.out_channels, "height", "width"))}


def _part_kind(part: type[TransformerPartSpec], kind: type[TransformerSpec]) -> type[TransformerPartSpec]:
    """The part's contract for one kind of transformer (``FluxEmbedSpec``, ``SD3OutSpec``, …): the part's class first
    in the bases, so its IO wins; the kind's for the rest (architecture, fields, latent layout)."""
    name = kind.__name__.removesuffix("TransformerSpec") + part.__name__.removesuffix("Part") + "Spec"
    return dataclass(frozen=True)(type(name, (part, kind), {"__module__": __name__, "__qualname__": name}))


PART_CLASSES: tuple[type[TransformerPartSpec], ...] = tuple(
    _part_kind(part, kind)
    for kind in (FluxTransformerSpec, SD3TransformerSpec)
    for part in (EmbedPart, FirstBlockPart, RestPart, OutPart)
)


def part_class(component: str, architecture: str) -> type[TransformerPartSpec]:
    return next(c for c in PART_CLASSES if c.component == component and c.architecture == architecture)


# The transformer's modules outside its blocks, by the part that holds them (diffusers' attribute names).
EMBEDDERS = ("x_embedder.", "context_embedder.", "time_text_embed.", "pos_embed.")
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


def split_problem(config: dict[str, Any], controlnet: bool = False) -> str | None:
    """Why this transformer cannot be split for step caches (a kind without parts; one block: nothing to skip; a
    ControlNet's samples, which no part takes), or None."""
    if controlnet:
        return "the step-cache members take no ControlNet block samples yet; compile without --caches"
    kind = config.get("_class_name", "")
    if kind and kind not in {c.architecture for c in PART_CLASSES}:
        return f"step caches are not built for a {kind} (SD3's and Flux.1's transformers only); compile without them"
    blocks = config.get("num_layers", 0) + config.get("num_single_layers", 0)
    return None if blocks >= 2 else f"it has {blocks} block, and a step cache skips the blocks after the first"
