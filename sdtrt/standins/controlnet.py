"""EngineControlNet: what a ControlNet pipeline calls instead of its ControlNetModel.

It is a ControlNetModel subclass — the ControlNet pipelines branch on ``isinstance(controlnet,
ControlNetModel)`` and ``MultiControlNetModel`` sums several of them — that builds none of the
model's layers: only its config, ``dtype`` and ``device`` and an engine behind ``forward``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ControlNetModel
from diffusers.models.controlnets.controlnet import ControlNetOutput

from ..core.errors import ArtifactError, EngineInputError
from ..runtime import Runtime
from ..spec import ControlNetSpec
from .base import EngineModule
from .unet import normalise_timestep


class EngineControlNet(EngineModule, ControlNetModel):
    """A ControlNetModel stand-in backed by a ControlNet engine (residuals out, summed by the pipeline)."""

    def __init__(self, runtime: Runtime, config: dict[str, Any], dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, ControlNetSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; a pipeline's controlnet needs a ControlNet"
            )
        if config.get("global_pool_conditions"):
            raise ArtifactError("ControlNets with global_pool_conditions are not supported by the engine stand-in")
        self.spec = runtime.spec
        self.runtime = runtime
        # An empty buffer: MultiControlNetModel (a ModelMixin) reads device and dtype from its nets' tensors.
        anchor = torch.empty(0, dtype=self.dtype, device=runtime.device)
        self.register_buffer("anchor", anchor, persistent=False)

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor | float | int, encoder_hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor, conditioning_scale: float = 1.0, class_labels: torch.Tensor | None = None,
        timestep_cond: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
        added_cond_kwargs: dict[str, torch.Tensor] | None = None, cross_attention_kwargs: dict[str, Any] | None = None,
        guess_mode: bool = False, return_dict: bool = True,
    ) -> ControlNetOutput | tuple[tuple[torch.Tensor, ...], torch.Tensor]:  # fmt: skip
        refused = {"class_labels": class_labels, "timestep_cond": timestep_cond, "attention_mask": attention_mask}
        if given := sorted(k for k, v in refused.items() if v is not None):
            raise EngineInputError(f"this ControlNet engine takes no {given}")
        spec = self.spec
        names = spec.input_names
        # The graph scales every residual by one number; guess mode's per-block scales are applied here.
        feeds = {
            names[0]: sample,
            names[1]: normalise_timestep(timestep, sample.shape[0], sample.device),
            names[2]: encoder_hidden_states,
            names[3]: controlnet_cond,
            names[4]: torch.tensor([1.0 if guess_mode else conditioning_scale], dtype=torch.float32),
        }
        added = added_cond_kwargs or {}
        if missing := [key for key in spec.canonical_inputs[5:] if key not in added]:
            raise EngineInputError(f"this ControlNet engine needs added_cond_kwargs {missing} (SDXL conditioning)")
        feeds |= {name: added[key] for name, key in zip(names[5:], spec.canonical_inputs[5:], strict=True)}
        outputs = self.runtime.run(feeds)
        residuals = [outputs[name].to(sample.device, sample.dtype) for name in spec.output_names]
        if guess_mode:  # as ControlNetModel.forward: logspace(-1, 0) from the first block to the mid block
            scales = torch.logspace(-1, 0, len(residuals), device=sample.device) * conditioning_scale
            residuals = [r * s for r, s in zip(residuals, scales, strict=True)]
        down, mid = tuple(residuals[:-1]), residuals[-1]
        if not return_dict:
            return down, mid
        return ControlNetOutput(down_block_res_samples=down, mid_block_res_sample=mid)  # type: ignore[arg-type]
