"""CLIP text encoders' graph contracts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision, Range, ShapeProfile
from .base import FOLDERS, TEXT_TOKENS, GraphSpec, ModelConfigs, TensorSpec, token_range


@dataclass(frozen=True)
class TextEncoderSpec(GraphSpec):
    """CLIP text encoders: token ids in; the outputs SD pipelines read (clip_skip 1 included)."""

    component: ClassVar[Component] = "text_encoder"
    label: ClassVar[str] = "text encoder"
    reads_pixels: ClassVar[bool] = False
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

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> TextEncoderSpec:
        """This component's contract for ``model``, from its configs."""
        folder = FOLDERS[cls.component]
        _, architecture = model.component_class(folder)
        return cls.from_config(
            model.component_config(folder), architecture, model.vae_scale_factor(), precision, io_naming
        )

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
class SequenceEncoderSpec(GraphSpec):
    """What a text encoder run at a token count shares (T5, an LLM): no pixels; its width, vocabulary and
    ``max_sequence_length``; a profile of token counts; one call per prompt list."""

    reads_pixels: ClassVar[bool] = False
    # max_sequence_length when the pipeline is called without one.
    pipeline_tokens: ClassVar[int]

    hidden_size: int = 4096
    vocab_size: int = 32128
    max_sequence_length: int = 256

    @property
    def default_tokens(self) -> int:
        return self.max_sequence_length

    @property
    def pixel_multiple(self) -> int:
        return 1  # no pixels: only the batch and token count of a profile matter here

    def batch_range(self, profile: ShapeProfile) -> Range:
        return Range(1, 1, profile.batch.max)  # one call per prompt list, positive and negative apart

    def default_profile(self) -> ShapeProfile:
        return ShapeProfile(tokens=token_range(self.max_sequence_length, self.pipeline_tokens))


@dataclass(frozen=True)
class T5EncoderSpec(SequenceEncoderSpec):
    """T5 (``T5EncoderModel``; SD3's text_encoder_3, Flux's text_encoder_2): token ids ``int32 [B, T]`` →
    ``last_hidden_state [B, T, d_model]``, as the pipelines call it (no attention mask). T is the profile's
    token axis (``max_sequence_length``)."""

    component: ClassVar[Component] = "text_encoder_3"
    label: ClassVar[str] = "T5 text encoder"
    architecture: ClassVar[str] = "T5EncoderModel"
    fp16_problem: ClassVar[str] = (
        "T5's feed-forward activations overflow fp16 (transformers keeps its wo projections fp32, "
        "T5PreTrainedModel._keep_in_fp32_modules; NVIDIA's demo/Diffusion notes known FP16 accuracy issues)"
    )
    canonical_inputs: ClassVar[tuple[str, ...]] = ("input_ids",)
    canonical_outputs: ClassVar[tuple[str, ...]] = ("last_hidden_state",)
    # max_sequence_length when the pipeline is called without one: StableDiffusion3Pipeline's.
    pipeline_tokens: ClassVar[int] = 256
    # Block 0 holds the relative attention bias; the position bias it computes is shared input to the others.
    repeated_blocks: ClassVar[dict[str, str]] = {"encoder.block": "num_layers"}

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> T5EncoderSpec:
        """This component's contract for ``model``: T5's width and vocabulary, the family's token count."""
        from ..core.families import T5_TOKENS, transformer_family

        config = model.component_config(FOLDERS[cls.component])
        tokens = (
            T5_TOKENS[transformer_family(model.component_config("transformer"))] if model.has("transformer") else 256
        )
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=model.vae_scale_factor(),
            hidden_size=config["d_model"], vocab_size=config["vocab_size"], max_sequence_length=tokens,
        )  # fmt: skip

    def inputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.input_names[0], "int32", ("batch", "tokens"))]

    def outputs(self) -> list[TensorSpec]:
        return [TensorSpec(self.output_names[0], self.dtype, ("batch", "tokens", self.hidden_size))]


@dataclass(frozen=True)
class T5Encoder2Spec(T5EncoderSpec):
    """Flux's T5, in ``text_encoder_2``."""

    component: ClassVar[Component] = "text_encoder_2"
    pipeline_tokens: ClassVar[int] = 512  # FluxPipeline's, dev's and schnell's alike
