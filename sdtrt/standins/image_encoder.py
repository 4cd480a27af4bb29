"""EngineImageEncoder: the module a diffusers pipeline calls instead of an IP-Adapter's CLIPVisionModelWithProjection,
so that its own ``encode_image`` runs over the engine (the plain IP-Adapter reads ``image_embeds``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import CLIPVisionModelWithProjection
from transformers.models.clip.modeling_clip import CLIPVisionModelOutput

from ..core.errors import ArtifactError, EngineInputError
from ..runtime import Runtime
from ..spec import ImageEncoderSpec
from .base import EngineModule


# transformers types `to`, `cuda` and `save_pretrained` differently; EngineModule's (first in the MRO) are called.
class EngineImageEncoder(EngineModule, CLIPVisionModelWithProjection):  # type: ignore[misc]
    """A CLIPVisionModelWithProjection stand-in backed by an image encoder engine."""

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, ImageEncoderSpec):
            raise ArtifactError(f"this is a {runtime.spec.component} engine; an image_encoder needs an image encoder's")
        self.spec = runtime.spec
        self.runtime = runtime
        # encode_image hands pixels over in the dtype of the encoder's first parameter: this empty one carries it.
        self.dtype_anchor = torch.nn.Parameter(torch.empty(0, dtype=self.dtype, device=runtime.device), False)

    def forward(
        self, pixel_values: torch.Tensor, output_hidden_states: bool | None = None, return_dict: bool = True,
        **_: Any,
    ) -> CLIPVisionModelOutput | tuple[torch.Tensor]:  # fmt: skip
        if output_hidden_states:
            raise EngineInputError(
                "this image encoder engine gives image_embeds only (the plain IP-Adapter's input), not hidden states "
                "(IP-Adapter Plus): run that on PyTorch (load_pipeline without an engine)"
            )
        spec = self.spec
        out = self.runtime.run({spec.input_names[0]: pixel_values})[spec.output_names[0]]
        embeds = out.to(pixel_values.device, self.dtype)
        return CLIPVisionModelOutput(image_embeds=embeds) if return_dict else (embeds,)
