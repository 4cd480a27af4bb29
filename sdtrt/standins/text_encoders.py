"""Text encoder stand-ins: what a diffusers pipeline calls instead of CLIPTextModel and T5EncoderModel.

Like EngineUNet, each keeps the module's call signature, ``config``, ``dtype``, ``device`` and output
classes, and refuses what its engine cannot do instead of silently doing something else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

from ..core.errors import ArtifactError, EngineInputError
from ..lora.refit import LoraNetwork
from ..runtime import Runtime
from ..spec import T5EncoderSpec, TextEncoderSpec
from .base import EngineModule
from .peft_adapters import PeftAdapters

if TYPE_CHECKING:
    from ..lora.refit import EngineLoras
    from ..sources.models import ModelSource


class PenultimateOnly(tuple):
    """``hidden_states`` of a text encoder engine: it has the penultimate layer's, the one ``clip_skip=1`` reads."""

    def __getitem__(self, index: Any) -> Any:
        if index in (-2, len(self) - 2):
            return super().__getitem__(index)
        raise EngineInputError(
            "this text encoder engine keeps the penultimate hidden state only (clip_skip=1), "
            f"not hidden_states[{index}]"
        )


class _TextModel(torch.nn.Module):
    """Just the part of ``CLIPTextModel.text_model`` pipelines reach into: ``final_layer_norm``."""

    def __init__(self, norm: torch.nn.Module | None) -> None:
        super().__init__()
        self.norm = norm

    def final_layer_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            raise EngineInputError("clip_skip needs the text model's final layer norm, which its weights file lacks")
        return self.norm.to(hidden.device, hidden.dtype)(hidden)


class EngineTextEncoder(EngineModule, PeftAdapters, LoraNetwork):
    """A CLIPTextModel / CLIPTextModelWithProjection stand-in backed by a text encoder engine.

    ``EngineTextEncoder(runtime, …)`` makes the subclass that is an instance of the class the engine's
    graph stands for: with a projection (``text_embeds``, SDXL's second encoder) or without.
    """

    def __new__(cls, runtime: Runtime, *args: Any, **kwargs: Any) -> EngineTextEncoder:
        if cls is EngineTextEncoder:
            projected = getattr(runtime.spec, "pooled_name", None) == "text_embeds"
            cls = EngineCLIPTextModelWithProjection if projected else EngineCLIPTextModel
        return super().__new__(cls)

    def __init__(
        self, runtime: Runtime, config: Any, final_layer_norm: torch.nn.Module | None,
        dtype: torch.dtype | None = None, loras: EngineLoras | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, TextEncoderSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a pipeline's text_encoder needs a text encoder engine"
            )
        self.spec = runtime.spec
        self.runtime = runtime
        # Pipelines apply the text model's final layer norm to hidden_states[-2] themselves (clip_skip).
        self.text_model = _TextModel(final_layer_norm)
        self.loras = loras

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool | None = None, return_dict: bool = True, **kwargs: Any,
    ) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutputWithPooling
        from transformers.models.clip.modeling_clip import CLIPTextModelOutput

        if attention_mask is not None:
            raise EngineInputError("this text encoder engine takes no attention_mask (SD's CLIP uses none)")
        hidden, pooled, penultimate = (
            self.runtime.run({self.spec.input_names[0]: input_ids})[name].to(input_ids.device, self._dtype)
            for name in self.spec.output_names
        )
        layers = self.config.num_hidden_layers
        hidden_states = PenultimateOnly((None,) * (layers - 1) + (penultimate, None))
        if self.spec.pooled_name == "text_embeds":
            out: Any = CLIPTextModelOutput(text_embeds=pooled, last_hidden_state=hidden, hidden_states=hidden_states)
        else:
            out = BaseModelOutputWithPooling(
                last_hidden_state=hidden, pooler_output=pooled, hidden_states=hidden_states
            )
        return out if return_dict else out.to_tuple()


# transformers types `to` and `save_pretrained` differently; EngineModule's (first in the MRO) are the ones called.
class EngineCLIPTextModel(EngineTextEncoder, CLIPTextModel):  # type: ignore[misc]
    """A text encoder engine standing in for a CLIPTextModel."""


class EngineCLIPTextModelWithProjection(EngineTextEncoder, CLIPTextModelWithProjection):  # type: ignore[misc]
    """A text encoder engine standing in for a CLIPTextModelWithProjection."""


class EngineT5(EngineModule, T5EncoderModel):  # type: ignore[misc]
    """A T5EncoderModel stand-in (SD3's text_encoder_3, Flux's text_encoder_2) backed by a T5 engine.

    Its graph is T5 as the pipelines call it: token ids in, ``last_hidden_state`` out, no attention mask.
    """

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, T5EncoderSpec):
            raise ArtifactError(f"this is a {runtime.spec.component} engine; a T5 text encoder needs a T5 engine")
        self.spec = runtime.spec
        self.runtime = runtime
        self.loras = None  # LoRAs on T5: none of the formats sdtrt reads target it

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool | None = None,
        return_dict: bool = True, **kwargs: Any,
    ) -> Any:  # fmt: skip
        from transformers.modeling_outputs import BaseModelOutput

        refused = {
            "attention_mask": attention_mask is not None,
            "inputs_embeds": inputs_embeds is not None,
            "output_hidden_states": bool(output_hidden_states),
        }
        if given := [name for name, on in refused.items() if on]:
            raise EngineInputError(
                f"this T5 engine takes token ids alone and gives last_hidden_state alone (as SD3's and Flux's "
                f"pipelines call T5), not {', '.join(given)}"
            )
        spec = self.spec
        hidden = self.runtime.run({spec.input_names[0]: input_ids})[spec.output_names[0]]
        out = BaseModelOutput(last_hidden_state=hidden.to(input_ids.device, self._dtype))
        return out if return_dict else out.to_tuple()


def text_encoder_config(source: ModelSource, folder: str = "text_encoder") -> Any:
    """The transformers config of a text encoder (pipelines read it, e.g. use_attention_mask, projection_dim)."""
    import transformers

    from ..sources.models import quiet_loading

    _, class_name = source.component_class(folder)
    with quiet_loading():
        return getattr(transformers, class_name).config_class.from_pretrained(source.component_dir(folder))


def final_layer_norm(source: ModelSource, config: Any, folder: str = "text_encoder") -> torch.nn.Module | None:
    """The text model's final LayerNorm, read alone from the weights (clip_skip applies it in the pipeline).

    transformers 4 saved it as ``text_model.final_layer_norm.*``, transformers 5 as ``final_layer_norm.*``.
    """
    from safetensors import safe_open

    path = source.component_dir(folder) / "model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as weights:
        names = set(weights.keys())
        for prefix in ("text_model.final_layer_norm.", "final_layer_norm."):
            if {prefix + "weight", prefix + "bias"} <= names:
                norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                norm.load_state_dict({p: weights.get_tensor(prefix + p) for p in ("weight", "bias")})
                return norm.eval()
    return None
