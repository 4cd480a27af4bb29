"""Calibration inputs for quantization: what the denoiser sees while the PyTorch pipeline denoises.

The model's own text-to-image pipeline (fp32) runs each calibration prompt for the configured steps; a forward
pre-hook on its denoiser records every call's arguments (classifier-free guidance batches, the scheduler's real
timesteps, the text embeddings), and ModelOpt's calibration replays them (ModelOpt's diffusers example calibrates
on denoising trajectories the same way, through its pipeline). One hook serves every denoiser kind: a UNet's calls,
or a transformer's keyword ones (SD3: hidden_states, encoder_hidden_states, pooled_projections, timestep; Flux adds
img_ids, txt_ids and guidance, its timestep already divided by 1000), named as its graph spec names its inputs.
Here, in the stages, the pipeline is loaded with diffusers directly: the pipelines layer sits above the stages.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError
from ..core.families import accepted
from ..core.progress import quiet_loading
from ..spec import denoiser_component

if TYPE_CHECKING:
    import torch

    from ..core.config import QuantizeConfig
    from ..sources.models import ModelSource


@dataclass
class CalibrationSet:
    """The denoiser's recorded calls, in order: (positional, keyword) arguments as the pipeline passed them."""

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)

    def replay(self, network: torch.nn.Module) -> None:
        """Run every recorded call through ``network``: ModelOpt's ``forward_loop``."""
        import torch

        with torch.no_grad():
            for args, kwargs in self.calls:
                network(*args, **kwargs)


def load_reference_pipeline(model: ModelSource) -> Any:
    """The model's diffusers pipeline in fp32 on the CPU, without a safety checker, its progress bar off."""
    import diffusers
    import torch

    with quiet_loading():
        cls = getattr(diffusers, model.pipeline_class())
        no_checker = {"safety_checker": None, "requires_safety_checker": False}
        pipe = cls.from_pretrained(model.path, dtype=torch.float32, local_files_only=True, **accepted(cls, no_checker))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_denoiser(pipe: Any, model: ModelSource) -> torch.nn.Module:
    """The pipeline's denoiser: its ``unet``, or its ``transformer`` (SD3, Flux), which the hook records."""
    return getattr(pipe, denoiser_component(model))


def record(pipe: Any, denoiser: torch.nn.Module, config: QuantizeConfig) -> CalibrationSet:
    """Run ``pipe`` over the config's prompts × steps (seeded per prompt) and record each call of ``denoiser``."""
    import torch

    parameters = inspect.signature(pipe.__call__).parameters
    if "image" in parameters:
        raise ConfigError(
            f"calibration runs the text-to-image pipeline, and {type(pipe).__name__} needs input images; "
            "quantize the text-to-image model of this family"
        )
    recorded = CalibrationSet()

    def keep(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        recorded.calls.append((_detached(args), _detached(kwargs)))

    hook = denoiser.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.no_grad():
            for index, prompt in enumerate(config.calibration_prompts):
                generator = torch.Generator().manual_seed(config.calibration_seed + index)
                pipe(
                    prompt=prompt, num_inference_steps=config.calibration_steps, generator=generator,
                    output_type="latent",
                )  # fmt: skip
    finally:
        hook.remove()
    return recorded


def _detached(value: Any) -> Any:
    """A copy of the call's tensors (the pipeline reuses its buffers between steps), structure kept."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value
