"""A decoder-only LLM as a text encoder (FLUX.2 [klein]'s Qwen3ForCausalLM, Z-Image's bare Qwen3Model, Qwen-Image's
Qwen2.5-VL language model): its graph contract.

The pipeline pads each chat-templated prompt to ``max_sequence_length`` with an attention mask, runs the LLM with
``output_hidden_states=True`` and stacks the hidden states of a few layers (klein's ``text_encoder_out_layers``, (9,
18, 27) by default) into the prompt embedding, or takes one (Z-Image's penultimate, each prompt's tokens alone).
The graph takes ``input_ids`` and ``attention_mask`` (int32 ``[B, T]``, T the profile's token axis) and gives only
what the pipeline reads: those layers' hidden states, stacked in the graph (``[B, layers, T, hidden]``, one output
instead of every layer's), never the logits.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ..core.config import Component, IONaming, Precision, Range, ShapeProfile, TokenCap
from ..core.errors import UnsupportedModelError
from ..core.families import (
    LLM_LAYERS,
    LLM_TOKENS,
    QWEN_IMAGE_DROPPED_TOKENS,
    QWEN_IMAGE_EDIT_DROPPED_TOKENS,
    QWEN_IMAGE_EDIT_PIPELINES,
)
from .base import FOLDERS, ModelConfigs, TensorSpec
from .qwen_vision import condition_tokens
from .text_encoder import SequenceEncoderSpec
from .transformer import klein_token_cap
from .transformer_qwen import EDIT_IMAGE_TOKENS, qwen_image_tokens

if TYPE_CHECKING:
    import torch

KLEIN_LAYERS = LLM_LAYERS["Flux2KleinPipeline"]
# Stored parameter names (as saved: Qwen2.5-VL's old ``model.layers.*`` and ``visual.*`` too) by what they are.
_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_NEVER_READ = re.compile(r"^lm_head\.|(?:^|\.)visual\.")
_FINAL_NORM = re.compile(r"^(?:model\.(?:language_model\.)?)?norm\.weight$")


def pipeline_layers(pipeline_class: str, num_hidden_layers: int) -> tuple[int, ...]:
    """The hidden states a pipeline reads from its LLM (LLM_LAYERS), as indices from 0: klein stacks three layers;
    Z-Image takes the penultimate layer's and keeps each prompt's tokens alone (its mask picks them out of the padded
    batch, so the engine's fixed-length rows give the same lists). Any other pipeline is refused: its layers are
    unknown."""
    if pipeline_class not in LLM_LAYERS:
        raise UnsupportedModelError(
            f"which hidden states a {pipeline_class or 'bare folder'}'s LLM text encoder gives is not known; sdtrt "
            f"builds the LLM encoders of {', '.join(LLM_LAYERS)}"
        )
    return tuple(k if k >= 0 else num_hidden_layers + 1 + k for k in LLM_LAYERS[pipeline_class])


@dataclass(frozen=True)
class LLMEncoderSpec(SequenceEncoderSpec):
    """Qwen3ForCausalLM in a pipeline's ``text_encoder``: token ids and their padding mask → the hidden states of
    ``hidden_layers`` (indices into transformers' ``hidden_states``: 0 is the embedding), stacked on axis 1."""

    component: ClassVar[Component] = "text_encoder"
    label: ClassVar[str] = "LLM text encoder"
    architecture: ClassVar[str] = "Qwen3ForCausalLM"
    canonical_inputs: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")
    canonical_outputs: ClassVar[tuple[str, ...]] = ("hidden_states",)
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["flux2"]
    fp16_problem: ClassVar[str] = (
        "Qwen3 is trained in bf16 and its activations overflow fp16 into inf/NaN (QwenLM/Qwen3 issues 761 and 868, "
        "transformers pull request 33312, on Qwen2-VL)"
    )
    fp16_fallback: ClassVar[Precision] = "bf16"
    token_cap: ClassVar[TokenCap] = klein_token_cap
    # Whether the decoder takes transformers' mask mapping (one mask per attention kind, as Qwen's do) rather than
    # one prepared [B, 1, T, T] mask.
    mask_mapping: ClassVar[bool] = True
    # Whether the pipeline's tokenizer pads on the left (Mistral's) and the stand-in takes such rows: the graph's mask
    # gives an all-padding row its own position, bit-exact with transformers' for left padding on MistralModel.
    left_padding: ClassVar[bool] = False

    hidden_size: int = 2560
    vocab_size: int = 151936
    hidden_layers: tuple[int, ...] = KLEIN_LAYERS
    max_sequence_length: int = LLM_TOKENS["flux2"]
    # How the graph finds a mask row that sees nothing (stages/llm_encoder.causal_padding_mask): in the spec's JSON,
    # so in the export key, because graphs from before it (a ReduceMax) fail check-blocks' shape inference.
    empty_mask_rows: Literal["cumsum"] = "cumsum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden_layers", tuple(self.hidden_layers))  # a list from JSON

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> LLMEncoderSpec:
        """This component's contract for ``model``: the LLM's width and vocabulary, the pipeline's layers."""
        config = model.component_config(FOLDERS[cls.component])
        text = config.get("text_config") or config  # a vision-language model's language part
        pipeline = model.pipeline_class() if model.is_pipeline else ""
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=model.vae_scale_factor(),
            hidden_size=text["hidden_size"], vocab_size=text["vocab_size"],
            hidden_layers=cls.layers_read(pipeline, text["num_hidden_layers"]),
            max_sequence_length=cls.pipeline_tokens,
        )  # fmt: skip

    @classmethod
    def layers_read(cls, pipeline_class: str, num_hidden_layers: int) -> tuple[int, ...]:
        """The hidden states the pipeline reads (``hidden_layers``)."""
        return pipeline_layers(pipeline_class, num_hidden_layers)

    def unread_parameters(self, config: Mapping[str, Any], names: Collection[str]) -> frozenset[str]:
        """The LM head, a vision tower, the decoder layers past the last one read (klein reads Qwen3-4B's
        ``hidden_states[27]``: layers 27-35 are dead code, which the exporter drops) and then the final norm."""
        layers = {n: int(m.group(1)) for n in names if (m := _DECODER_LAYER.search(n))}
        read_up_to = max(self.hidden_layers)  # hidden_states[k] is layer k-1's output
        reads_last = read_up_to > max(layers.values(), default=-1)
        return frozenset(
            n for n in names
            if _NEVER_READ.search(n) or layers.get(n, -1) >= read_up_to or (not reads_last and _FINAL_NORM.search(n))
        )  # fmt: skip

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(name, "int32", ("batch", "tokens")) for name in self.input_names]

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", len(self.hidden_layers), "tokens", self.hidden_size)
        return [TensorSpec(self.output_names[0], self.dtype, shape)]

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, dtype: torch.dtype | None = None,
        tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Random ids, and a mask that pads each row after a random length (as Qwen's tokenizer pads), or before it
        where the family's tokenizer pads on the left."""
        import torch

        ids, mask = self.input_names[:2]
        feeds = super().sample_inputs(batch, height_px, width_px, seed=seed, dtype=dtype, tokens=tokens)
        count = feeds[ids].shape[1]
        lengths = torch.randint(1, count + 1, (batch, 1), generator=torch.Generator().manual_seed(seed + 1))
        padding = (torch.arange(count)[None, :] < lengths).int()
        return feeds | {mask: padding.flip(1) if self.left_padding else padding}


@dataclass(frozen=True)
class QwenVLEncoderSpec(LLMEncoderSpec):
    """Qwen2.5-VL's language model in QwenImagePipeline's ``text_encoder`` (Qwen2_5_VLForConditionalGeneration, its
    vision tower unused for text): the last layer's hidden states (``hidden_states[-1]``), one stacked layer. The
    pipeline tokenizes its chat template around the prompt, runs it all and drops the template's first 34 tokens, so
    the engine reads 34 tokens more than the transformer (up to 1024 + 34): its profile is the transformer's, shifted
    by 34. Text-only positions are 0..T-1 on all three
    rotary sections (transformers' default without image grids), as in Qwen3."""

    architecture: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["qwenimage"] + QWEN_IMAGE_DROPPED_TOKENS
    token_cap: ClassVar[TokenCap] = TokenCap(
        pipeline_tokens,
        "QwenImagePipeline's Qwen2.5-VL encoder reads",
        "tokens (the transformer's and the 34 it drops)",
    )
    fp16_problem: ClassVar[str] = (
        "Qwen2.5-VL is a bf16 model (Qwen-Image ships it in bf16) of the Qwen LLMs whose activations overflow fp16 "
        "(transformers pull request 33312, on Qwen2-VL)"
    )

    # The template's leading tokens the pipeline drops: the engine reads this many more than the transformer.
    dropped_tokens: ClassVar[int] = QWEN_IMAGE_DROPPED_TOKENS

    hidden_layers: tuple[int, ...] = (28,)  # Qwen2.5-VL-7B's last

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> LLMEncoderSpec:
        """An Edit pipeline's text encoder takes its image's embeddings too (QwenVLImageEncoderSpec)."""
        spec = super().for_model(model, precision, io_naming)
        if (
            cls is not QwenVLEncoderSpec
            or not model.is_pipeline
            or model.pipeline_class() not in QWEN_IMAGE_EDIT_PIPELINES
        ):
            return spec
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        return QwenVLImageEncoderSpec(
            **fields | {"max_sequence_length": QwenVLImageEncoderSpec.pipeline_tokens},
            image_token_id=model.component_config(FOLDERS[cls.component])["image_token_id"],
            condition_tokens=condition_tokens(model),
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Any:
        """The spec a manifest recorded: an Edit pipeline's where it names an image token."""
        if cls is QwenVLEncoderSpec and "image_token_id" in data:
            return QwenVLImageEncoderSpec.from_json(data)
        return super().from_json(data)

    @classmethod
    def layers_read(cls, pipeline_class: str, num_hidden_layers: int) -> tuple[int, ...]:
        return (num_hidden_layers,)

    def default_profile(self) -> ShapeProfile:
        """The transformer's default tokens, and the template's dropped ones."""
        return self.member_profile(ShapeProfile(tokens=qwen_image_tokens()))

    def member_profile(self, profile: ShapeProfile) -> ShapeProfile:
        if profile.tokens is None:
            return profile
        return dataclasses.replace(profile, tokens=Range(*(n + self.dropped_tokens for n in profile.tokens)))


@dataclass(frozen=True)
class QwenVLImageEncoderSpec(QwenVLEncoderSpec):
    """QwenImageEditPipeline's Qwen2.5-VL language model on a prompt with an image: ``image_embeds
    [vision_tokens, hidden]`` too (the vision tower engine's, all images' in the processor's order), which the graph
    puts in place of the prompt's ``image_token_id`` tokens, in order, as transformers' ``masked_scatter`` does. The
    positions stay 0..T-1 on all three rotary sections: the pipeline passes no ``mm_token_type_ids``, without which
    transformers 5.x computes no multimodal positions (``compute_3d_position_ids``). Its template drops 64 tokens.
    The pipeline never cuts the prompt to ``max_sequence_length``, and the prompt holds its image's tokens (1369 for
    its ~1024² condition image): the cap and default profile add the vision tower's default image to the text's."""

    canonical_inputs: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask", "image_embeds")
    dropped_tokens: ClassVar[int] = QWEN_IMAGE_EDIT_DROPPED_TOKENS
    pipeline_tokens: ClassVar[int] = LLM_TOKENS["qwenimage"] + QWEN_IMAGE_EDIT_DROPPED_TOKENS + EDIT_IMAGE_TOKENS.max
    token_cap: ClassVar[TokenCap] = TokenCap(
        pipeline_tokens,
        "QwenImageEditPipeline's Qwen2.5-VL encoder reads",
        f"tokens (the transformer's {LLM_TOKENS['qwenimage']}, the {QWEN_IMAGE_EDIT_DROPPED_TOKENS} it drops and "
        f"up to {EDIT_IMAGE_TOKENS.max} of its image)",
    )

    image_token_id: int = 151655  # Qwen2.5-VL's <|image_pad|>
    # One condition image's tokens (smallest, tuned, largest) by the model's processor: the checkpoints' by default.
    condition_tokens: tuple[int, int, int] = EDIT_IMAGE_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "condition_tokens", tuple(self.condition_tokens))  # a list from JSON

    def inputs(self) -> list[TensorSpec]:
        ids, mask, embeds = self.input_names
        tokens = [TensorSpec(name, "int32", ("batch", "tokens")) for name in (ids, mask)]
        return [*tokens, TensorSpec(embeds, self.dtype, ("vision_tokens", self.hidden_size))]

    def axis_sizes(self, batch: int, height_px: int, width_px: int, tokens: int = 0) -> dict[str, int]:
        """Image embeddings: at most one a token of each prompt."""
        sizes = super().axis_sizes(batch, height_px, width_px, tokens)
        return sizes | {"vision_tokens": batch * sizes["tokens"]}

    def profile_shapes(self, profile: ShapeProfile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """From one image embedding up to a token of each prompt each."""
        shapes = super().profile_shapes(profile)
        embeds = self.input_names[2]
        _, opt, most = shapes[embeds]
        return shapes | {embeds: ((1, self.hidden_size), opt, most)}

    def default_profile(self) -> ShapeProfile:
        """The text's default tokens, the template's dropped ones and the tokens of one condition image of the vision
        tower's default profile (``condition_tokens``, by the model's processor), at each of its smallest, tuned and
        largest."""
        text_and_image = zip(qwen_image_tokens(), self.condition_tokens, strict=True)
        return ShapeProfile(tokens=Range(*(t + self.dropped_tokens + i for t, i in text_and_image)))

    def sample_inputs(
        self, batch: int, height_px: int, width_px: int, *, seed: int = 0, dtype: torch.dtype | None = None,
        tokens: int = 0,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """Random ids whose first half of each row is image tokens (none elsewhere), an embedding for each."""
        import torch

        feeds = super().sample_inputs(batch, height_px, width_px, seed=seed, dtype=dtype, tokens=tokens)
        ids, _, embeds = self.input_names
        half = feeds[ids].shape[1] // 2
        text = feeds[ids].masked_fill(feeds[ids] == self.image_token_id, 0)
        text[:, :half] = self.image_token_id
        images = torch.randn(batch * half, self.hidden_size, generator=torch.Generator().manual_seed(seed + 2))
        return feeds | {ids: text, embeds: images.to(feeds[embeds].dtype)}


@dataclass(frozen=True)
class LLMModelEncoderSpec(LLMEncoderSpec):
    """The same contract for a Qwen3Model (the decoder stack without the LM head), the class Z-Image's checkpoints
    name in ``text_encoder``: the same graph; its row of SPEC_CLASSES keeps it from CLIP's."""

    architecture: ClassVar[str] = "Qwen3Model"


@dataclass(frozen=True)
class MistralEncoderSpec(LLMEncoderSpec):
    """Mistral-Small-3.x's language model in Flux2Pipeline's ``text_encoder`` (Mistral3ForConditionalGeneration, its
    Pixtral vision tower unused for text): ``hidden_states[10, 20, 30]`` stacked. MistralModel builds its mask itself
    from what it is given, and returns a prepared 4D mask as it is: the graph hands it one."""

    architecture: ClassVar[str] = "Mistral3ForConditionalGeneration"
    mask_mapping: ClassVar[bool] = False
    left_padding: ClassVar[bool] = True
    fp16_problem: ClassVar[str] = (
        "Mistral-Small-3.x is a bf16 model (FLUX.2 [dev] ships it in bf16) whose activations are not known to stay "
        "inside fp16's range"
    )

    hidden_layers: tuple[int, ...] = LLM_LAYERS["Flux2Pipeline"]

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> LLMEncoderSpec:
        """As an LLM encoder's; a sliding window shorter than the prompt is refused: the graph's prepared mask has
        none (MistralModel builds a windowed mask only when it builds the mask itself)."""
        config = model.component_config(FOLDERS[cls.component])
        window = (config.get("text_config") or config).get("sliding_window")
        if window is not None and window < cls.pipeline_tokens:
            raise UnsupportedModelError(
                f"this Mistral text encoder attends through a sliding window of {window} tokens, fewer than the "
                f"{cls.pipeline_tokens} Flux2Pipeline reads, and the engine's mask has no window: sdtrt builds "
                "Mistral-Small-3.x's (sliding_window null)"
            )
        return super().for_model(model, precision, io_naming)
