"""EngineFluxControlNet: what FluxControlNetPipeline calls instead of its FluxControlNetModel; and the samples it gives,
as the Flux transformer engine of a ControlNet set takes them (``controlnet_feeds``).

It is a FluxControlNetModel subclass — the pipeline branches on ``isinstance(controlnet, FluxControlNetModel)``, reads
``input_hint_block`` (None: InstantX's kind, the control image VAE-encoded and packed, its samples not repeated) and
``config.guidance_embeds``, and FluxMultiControlNetModel sums several (passing -1 as each one's mode) — that builds
none of the model's layers.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxControlNetModel
from diffusers.models.controlnets.controlnet_flux import FluxControlNetOutput

from ..core.errors import ArtifactError, EngineInputError
from ..runtime import Runtime
from ..spec import FluxControlNetSpec, FluxTransformerSpec
from ..spec.controlnet_samples import controlnet_sample_names
from .base import EngineModule
from .unet import normalise_timestep


class EngineFluxControlNet(EngineModule, FluxControlNetModel):
    """A FluxControlNetModel stand-in backed by a FLUX.1 ControlNet engine (block samples out, the transformer adds)."""

    input_hint_block = None  # InstantX's kind: the only one the spec exports

    def __init__(self, runtime: Runtime, config: dict[str, Any], dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype or runtime.dtype, [runtime])
        if not isinstance(runtime.spec, FluxControlNetSpec):
            raise ArtifactError(
                f"this is a {runtime.spec.component} engine; FluxControlNetPipeline's controlnet needs a FLUX.1 "
                "ControlNet engine"
            )
        self.spec = runtime.spec
        self.runtime = runtime
        # An empty buffer: FluxMultiControlNetModel (a ModelMixin) reads device and dtype from its nets' tensors.
        self.register_buffer("anchor", torch.empty(0, dtype=self.dtype, device=runtime.device), persistent=False)

    def forward(
        self, hidden_states: torch.Tensor, controlnet_cond: torch.Tensor, controlnet_mode: torch.Tensor | None = None,
        conditioning_scale: float = 1.0, encoder_hidden_states: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None, timestep: torch.Tensor | None = None,
        img_ids: torch.Tensor | None = None, txt_ids: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None, return_dict: bool = True,
    ) -> FluxControlNetOutput | tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:  # fmt: skip
        # controlnet_mode is ControlNet-Union's, whose models the spec refuses; FluxMultiControlNetModel passes -1s,
        # which a single-mode FluxControlNetModel ignores, as the engine does.
        if joint_attention_kwargs:
            raise EngineInputError(
                f"joint_attention_kwargs {sorted(joint_attention_kwargs)} change the engine's attention, which is "
                "fixed at build: run this pipeline on PyTorch (load_pipeline without an engine)"
            )
        if guidance is not None and not self.spec.guidance_embeds:
            raise EngineInputError("this FLUX.1 ControlNet engine takes no guidance (its model embeds none)")
        batch, device = hidden_states.shape[0], hidden_states.device
        # Positions per batch row (diffusers' deprecated 3-D ids) are read from the first row, as its forward does.
        img_ids, txt_ids = (ids[0] if ids is not None and ids.ndim == 3 else ids for ids in (img_ids, txt_ids))
        given: dict[str, Any] = {
            "hidden_states": hidden_states, "controlnet_cond": controlnet_cond,
            "conditioning_scale": torch.tensor([float(conditioning_scale)], dtype=torch.float32),
            "encoder_hidden_states": encoder_hidden_states, "pooled_projections": pooled_projections,
            "timestep": None if timestep is None else normalise_timestep(timestep, batch, device),
            "img_ids": None if img_ids is None else img_ids.float(),
            "txt_ids": None if txt_ids is None else txt_ids.float(),
            "guidance": None if guidance is None else normalise_timestep(guidance, batch, device),
        }  # fmt: skip
        if missing := [name for name in self.spec.canonical_inputs if given[name] is None]:
            raise EngineInputError(f"this FLUX.1 ControlNet engine needs {missing}, which the pipeline did not pass")
        names = zip(self.spec.input_names, self.spec.canonical_inputs, strict=True)
        outputs = self.runtime.run({graph: given[name] for graph, name in names})
        samples = [outputs[name].to(device, hidden_states.dtype) for name in self.spec.output_names]
        count = self.spec.controlnet_samples[0]
        blocks, singles = samples[:count] or None, samples[count:] or None  # diffusers' None for none
        if not return_dict:
            return blocks, singles
        # Lists, as diffusers' own forward hands them (its output class says tuples).
        output = FluxControlNetOutput(controlnet_block_samples=blocks, controlnet_single_block_samples=singles)  # type: ignore[arg-type]
        return output


def controlnet_feeds(
    spec: FluxTransformerSpec, hidden_states: torch.Tensor, blocks: list[torch.Tensor] | None,
    singles: list[torch.Tensor] | None, repeat: bool,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """A FLUX.1 ControlNet set's transformer inputs, by canonical name, from what FluxControlNetPipeline passes: the
    ControlNet's samples, zeros where it passes none (adding zero changes nothing); EngineInputError for samples of
    another count than the engine's graph adds, or XLabs' repeated ones. {} for a plain FLUX.1 engine, which takes
    none (EngineTransformer refuses them)."""
    names = controlnet_sample_names(spec.controlnet_samples)
    if not names:
        return {}
    if repeat:
        raise EngineInputError(
            "controlnet_blocks_repeat=True: XLabs-style ControlNet samples repeated over the blocks, which this "
            "transformer engine does not take (its graph spreads an InstantX-style ControlNet's samples)"
        )
    zeros = torch.zeros(
        *hidden_states.shape[:2], spec.controlnet_width, dtype=hidden_states.dtype, device=hidden_states.device
    )
    given = []
    for samples, count, what in zip((blocks, singles), spec.controlnet_samples, ("double", "single"), strict=True):
        if samples is not None and len(samples) != count:
            raise EngineInputError(
                f"this transformer engine adds {count} {what}-block ControlNet samples, as its set's ControlNet gives; "
                f"got {len(samples)}"
            )
        given += list(samples) if samples is not None else [zeros] * count
    return dict(zip(names, given, strict=True))
