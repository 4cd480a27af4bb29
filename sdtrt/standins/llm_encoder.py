"""EngineQwen3 / EngineQwen3Model / EngineQwen2_5_VL / EngineMistral3: what FLUX.2 [klein]'s, Z-Image's, Qwen-Image's
and FLUX.2 [dev]'s pipelines call instead of their LLM text encoders (Qwen3ForCausalLM; the bare Qwen3Model Z-Image's
checkpoints name; Qwen2_5_VLForConditionalGeneration, with an image for Qwen-Image-Edit, and
Mistral3ForConditionalGeneration, text only).

The pipelines read nothing of the LLM's output but ``hidden_states[k]`` (klein's ``text_encoder_out_layers``,
Qwen-Image's last layer, as ``hidden_states[-1]``); the
engine's graph gives those layers' hidden states stacked (spec/llm_encoder.py), and the stand-in hands them back as
``hidden_states`` indexed as transformers indexes them, so the pipeline's own code stacks them unchanged. Logits,
a KV cache, generation and other layers are refused in one line: the engine has none of them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Mistral3ForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3Model,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.mistral3.modeling_mistral3 import Mistral3CausalLMOutputWithPast

from ..core.errors import ArtifactError, EngineInputError
from ..runtime import Runtime
from ..spec import LLMEncoderSpec, QwenVLImageEncoderSpec
from .base import EngineModule

NOT_A_GENERATOR = (
    "an LLM text encoder engine gives the hidden states of the layers its pipeline reads, not logits or a KV cache: "
    "load the model without an engine to generate text"
)


class SelectedLayers(tuple):
    """``hidden_states`` of an LLM encoder engine: the entries of the layers it was built for (transformers' indices:
    0 the embedding, i the i-th layer's output); any other index is refused."""

    layers: tuple[int, ...]

    def __new__(cls, stacked: torch.Tensor, layers: tuple[int, ...], count: int) -> SelectedLayers:
        chosen = dict(zip(layers, stacked.unbind(1), strict=True))
        out = super().__new__(cls, tuple(chosen.get(i) for i in range(count)))
        out.layers = layers
        return out

    def __getitem__(self, index: Any) -> Any:
        value = super().__getitem__(index)
        if value is None:
            raise EngineInputError(
                f"this LLM text encoder engine keeps hidden_states{list(self.layers)} (the layers its pipeline "
                f"stacks), not hidden_states[{index}]: call the pipeline with text_encoder_out_layers={self.layers}, "
                "or run it on PyTorch (load_pipeline without an engine)"
            )
        return value


class EngineLLMEncoder(EngineModule):
    """An LLM text encoder stand-in backed by an LLM encoder engine. ``EngineLLMEncoder(runtime, …)`` makes the
    subclass that is an instance of the class the engine's graph was exported from (its spec's architecture), which
    returns that class's output type (only ``hidden_states`` filled)."""

    output_class: Any = CausalLMOutputWithPast

    def __new__(cls, runtime: Runtime, *args: Any, **kwargs: Any) -> EngineLLMEncoder:
        if cls is EngineLLMEncoder:
            cls = STANDINS.get(runtime.spec.architecture, EngineQwen3)
        return super().__new__(cls)

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, LLMEncoderSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a Qwen3 text encoder needs an LLM encoder engine"
            )
        self.spec: LLMEncoderSpec = runtime.spec
        self.runtime = runtime
        self.loras = None  # LoRAs on the LLM: none of the formats sdtrt reads target it

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None, use_cache: bool | None = None, return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        images = self.image_inputs(kwargs)  # taken out of kwargs, run once the call is known to be one it takes
        refused = {"output_hidden_states=False": not output_hidden_states, "use_cache=True": bool(use_cache)}
        refused |= {name: value is not None for name, value in kwargs.items()}
        if given := [name for name, on in refused.items() if on]:
            raise EngineInputError(f"{', '.join(given)}: {NOT_A_GENERATOR}")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if not one_run_of_tokens(mask, self.spec.left_padding):
            sides = "padded on either side" if self.spec.left_padding else "right-padded"
            raise EngineInputError(
                f"the attention_mask has a row that is all padding or not one run of tokens: this LLM text encoder "
                f"engine takes {sides} rows with at least one token; pad each prompt on "
                + ("one side" if self.spec.left_padding else "the right (tokenizer.padding_side='right')")
            )
        ids, mask_name = self.spec.input_names[:2]
        feeds = {ids: input_ids, mask_name: mask} | self.image_feeds(images, input_ids)
        stacked = self.runtime.run(feeds)[self.spec.output_names[0]]
        stacked = stacked.to(input_ids.device, self._dtype)
        layers = self.config.get_text_config().num_hidden_layers  # a vision-language model's: its language part's
        hidden = SelectedLayers(stacked, self.spec.hidden_layers, layers + 1)
        out = self.output_class(hidden_states=hidden)
        return out if return_dict else out.to_tuple()

    def image_inputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The image inputs the engine takes, out of the call's ``kwargs``: none here (a text encoder's image inputs
        are refused as any other keyword)."""
        return {}

    def image_feeds(self, images: dict[str, Any], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The engine's feeds from those image inputs, for the prompt ``input_ids``."""
        return {}

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise EngineInputError(f"{type(self).__name__}.generate: {NOT_A_GENERATOR}")


class EngineQwen3(EngineLLMEncoder, Qwen3ForCausalLM):  # type: ignore[misc]
    """A Qwen3ForCausalLM stand-in (FLUX.2 [klein]'s text_encoder)."""


class EngineQwen3Model(EngineLLMEncoder, Qwen3Model):  # type: ignore[misc]
    """A Qwen3Model stand-in (Z-Image's text_encoder)."""

    output_class = BaseModelOutputWithPast


class EngineQwen2_5_VL(EngineLLMEncoder, Qwen2_5_VLForConditionalGeneration):  # type: ignore[misc]
    """A Qwen2_5_VLForConditionalGeneration stand-in (Qwen-Image's text_encoder). An engine built for an Edit
    pipeline (QwenVLImageEncoderSpec) takes a prompt with an image: the pipeline's ``pixel_values`` and
    ``image_grid_thw`` go through the vision tower stand-in (``use_vision``), whose embeddings the graph puts in
    place of the image tokens; a text-only engine refuses image inputs as any other keyword it does not take."""

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(runtime, config, dtype)
        self.vision: Any = None  # EngineQwen2_5_VisionTower, for an engine that takes images

    def use_vision(self, tower: Any) -> None:
        """The vision tower stand-in whose image embeddings this engine takes."""
        self.vision = tower

    def image_inputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(self.spec, QwenVLImageEncoderSpec):
            return {}
        images = {name: kwargs.pop(name, None) for name in ("pixel_values", "image_grid_thw")}
        if None in images.values():
            raise EngineInputError(
                "this Qwen2.5-VL engine was built for a prompt with an image (QwenImageEditPipeline's): pass "
                "pixel_values and image_grid_thw, as the pipeline's processor gives them"
            )
        if self.vision is None:
            raise ArtifactError(
                "this Qwen2.5-VL engine takes image embeddings, and no vision tower engine is beside it"
            )
        return images

    def image_feeds(self, images: dict[str, Any], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tower's embeddings, once the prompt is known to have a token for each (transformers refuses a
        mismatch in get_placeholder_mask; the graph would gather past the embeddings or drop some)."""
        if not images:
            return {}
        assert isinstance(self.spec, QwenVLImageEncoderSpec)  # image_inputs gives images only to such an engine
        tokens = int((input_ids == self.spec.image_token_id).sum())
        made = int(images["image_grid_thw"].prod(-1).sum()) // self.vision.spatial_merge_size**2
        if tokens != made:
            raise EngineInputError(
                f"the prompts hold {tokens} image tokens and their images make {made} image embeddings: tokenize "
                "each prompt with its images, as the pipeline's processor does (one image token a merged patch group)"
            )
        pixels = images["pixel_values"].type(self.vision.dtype)
        embeds = self.vision(pixels, grid_thw=images["image_grid_thw"]).pooler_output
        return {self.spec.input_names[2]: embeds}


class EngineMistral3(EngineLLMEncoder, Mistral3ForConditionalGeneration):  # type: ignore[misc]
    """A Mistral3ForConditionalGeneration stand-in (FLUX.2 [dev]'s text_encoder), its text path: pixel_values (only
    the prompt upsampling's generate passes them) are refused as any other keyword the engine does not take."""

    output_class = Mistral3CausalLMOutputWithPast


# The engine's architecture (its spec's) → the stand-in class that is an instance of that transformers class.
STANDINS: dict[str, type[EngineLLMEncoder]] = {
    pytorch.__name__: standin for pytorch, standin in (
        (Qwen3ForCausalLM, EngineQwen3), (Qwen3Model, EngineQwen3Model),
        (Qwen2_5_VLForConditionalGeneration, EngineQwen2_5_VL), (Mistral3ForConditionalGeneration, EngineMistral3),
    )
}  # fmt: skip


def one_run_of_tokens(mask: torch.Tensor, left: bool) -> bool:
    """Whether every row of a ``[B, T]`` padding mask is tokens then padding, its first position a token, or, where
    ``left``, padding then tokens, its last a token: the rows the engine's graph masks as transformers does (its
    positions count from the row's start, pads included, as transformers' do)."""
    tokens = mask.bool()
    right = bool(tokens[:, 0].all() and (tokens[:, 1:] <= tokens[:, :-1]).all())
    return right or (left and bool(tokens[:, -1].all() and (tokens[:, 1:] >= tokens[:, :-1]).all()))
