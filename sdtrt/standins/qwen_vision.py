"""EngineQwen2_5_VisionTower: what a Qwen2.5-VL text encoder calls instead of its vision tower (``model.visual``,
which ``get_image_features`` runs on the processor's patches when the Qwen-Image-Edit pipelines pass their image).

The stand-in reckons what the grid alone gives (spec/qwen_vision.py ``grid_inputs``), runs the engine on the
patches in window order and hands back the merged embeddings in the processor's order as ``pooler_output``, the one
output ``get_image_features`` reads."""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

from ..core.errors import ArtifactError, EngineInputError
from ..runtime import Runtime
from ..spec import QwenVisionTowerSpec
from .base import EngineModule


class EngineQwen2_5_VisionTower(EngineModule, Qwen2_5_VisionTransformerPretrainedModel):  # type: ignore[misc]
    """A Qwen2_5_VisionTransformerPretrainedModel stand-in backed by a vision tower engine."""

    def __init__(self, runtime: Runtime, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, QwenVisionTowerSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a Qwen2.5-VL vision tower needs a vision_encoder engine"
            )
        self.spec: QwenVisionTowerSpec = runtime.spec
        self.runtime = runtime
        self.spatial_merge_size = config.spatial_merge_size  # what get_image_features splits the embeddings by

    def forward(self, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPooling:
        if given := [name for name, value in kwargs.items() if value is not None]:
            raise EngineInputError(
                f"{', '.join(given)}: a vision tower engine gives the merged image embeddings (pooler_output) of the "
                "processor's patches and grid, nothing else"
            )
        if hidden_states.shape[-1] != self.spec.patch_values:
            raise EngineInputError(
                f"pixel_values of {hidden_states.shape[-1]} values a patch; this vision tower engine takes "
                f"{self.spec.patch_values} (channels × temporal patch × patch²)"
            )
        grid = self.spec.grid_inputs(grid_thw.cpu())
        device = hidden_states.device
        feeds = self.spec.feeds(hidden_states[grid.order.to(device)], grid)
        merged = self.runtime.run(feeds)[self.spec.output_names[0]]
        merged = merged.to(device, self._dtype)[grid.restore.to(device)]
        return BaseModelOutputWithPooling(pooler_output=merged)
