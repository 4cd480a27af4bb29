"""Text encoder and VAE stand-ins: what a diffusers pipeline calls instead of CLIPTextModel and AutoencoderKL.

Like EngineUNet, each keeps the module's call signature, ``config``, ``dtype``, ``device`` and output
classes, and refuses what its engine cannot do instead of silently doing something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import ArtifactError, EngineInputError
from .lora import LoraNetwork
from .runtime import Runtime
from .spec import TextEncoderSpec

if TYPE_CHECKING:
    from .lora import EngineLoras
    from .models import ModelSource


class EngineModule(torch.nn.Module):
    """What pipelines read off every network: ``config``, ``dtype`` (the pipeline's), ``device`` (the engine's)."""

    def __init__(self, config: Any, dtype: torch.dtype, runtimes: list[Runtime | None]) -> None:
        super().__init__()
        self._config = config
        self._dtype = dtype  # fp16 engines still hand fp32 callers fp32 outputs
        self._runtimes = [r for r in runtimes if r is not None]

    @property
    def config(self) -> Any:
        return self._config

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._runtimes[0].device if self._runtimes else torch.device("cpu")


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


class EngineTextEncoder(EngineModule, LoraNetwork):
    """A CLIPTextModel / CLIPTextModelWithProjection stand-in backed by a text encoder engine."""

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


class EngineVAE(EngineModule):
    """An AutoencoderKL stand-in: ``decode`` and ``encode`` on engines; a half the set lacks runs in PyTorch."""

    def __init__(
        self, config: dict[str, Any], decoder: Runtime | None, encoder: Runtime | None,
        pytorch: Callable[[], Any], dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        from diffusers.configuration_utils import FrozenDict

        super().__init__(FrozenDict(config), dtype, [decoder, encoder])
        self.decoder_runtime, self.encoder_runtime = decoder, encoder
        self._pytorch_loader = pytorch
        self._pytorch: Any = None  # loaded on first use, only where the set lacks a half

    def _fallback(self) -> Any:
        if self._pytorch is None:
            self._pytorch = self._pytorch_loader().to(self.device, self._dtype)
        return self._pytorch

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator: Any = None) -> Any:
        from diffusers.models.autoencoders.vae import DecoderOutput

        if self.decoder_runtime is None:
            return self._fallback().decode(z, return_dict=return_dict, generator=generator)
        spec = self.decoder_runtime.spec
        image = self.decoder_runtime.run({spec.input_names[0]: z})[spec.output_names[0]].to(z.device, z.dtype)
        return DecoderOutput(sample=image) if return_dict else (image,)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        if self.encoder_runtime is None:
            return self._fallback().encode(x, return_dict=return_dict)
        spec = self.encoder_runtime.spec
        moments = self.encoder_runtime.run({spec.input_names[0]: x})[spec.output_names[0]].to(x.device, x.dtype)
        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)


def text_encoder_config(source: ModelSource, folder: str = "text_encoder") -> Any:
    """The transformers config of a text encoder (pipelines read it, e.g. use_attention_mask, projection_dim)."""
    import transformers

    from .models import quiet_loading

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
