"""Ready diffusers pipelines whose UNet is an engine: same call, same images."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ModelNotFoundError
from .models import ModelSource, quiet_loading, resolve_model
from .request import SCHEDULERS, GenerateRequest, SizeRule, check_scheduler
from .runtime import open_runtime
from .store import Artifact
from .unet import EngineUNet

if TYPE_CHECKING:
    from .compile import CompileResult

__all__ = ["SCHEDULERS", "GenerateRequest", "generate", "load_pipeline", "set_scheduler", "with_unet"]


def set_scheduler(pipe: Any, name: str) -> None:
    import diffusers

    pipe.scheduler = getattr(diffusers, check_scheduler(name)).from_config(pipe.scheduler.config)


def load_pipeline(
    model: str | ModelSource,
    engine: str | os.PathLike[str] | Artifact | CompileResult | None = None,
    *,
    scheduler: str | None = None,
    img2img: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A StableDiffusion(Img2Img)Pipeline for ``model``; with ``engine``, its UNet runs on the engine.

    ``engine`` is an artifact directory (or file inside one) from ``sdtrt compile``/``build``, an
    Artifact, or what ``compile_model`` returned. Without it the pipeline is plain PyTorch: the
    reference the engine is checked against.
    """
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

    source = model if isinstance(model, ModelSource) else resolve_model(model)
    if not source.is_pipeline:
        raise ModelNotFoundError(f"'{source.path}' is a bare UNet folder; a pipeline needs the whole model folder")
    cls = StableDiffusionImg2ImgPipeline if img2img else StableDiffusionPipeline
    # With an engine, skip loading the PyTorch UNet (3.4 GB for SD 1.5); diffusers type-checks
    # components given to from_pretrained, so the engine goes in through the constructor.
    unet_override = {"unet": None} if engine is not None else {}
    with quiet_loading():
        pipe = cls.from_pretrained(
            source.path, dtype=dtype, local_files_only=True, safety_checker=None, requires_safety_checker=False,
            **unet_override,
        )  # fmt: skip
    if engine is not None:
        artifact = _as_artifact(engine)
        pipe = with_unet(pipe, EngineUNet(open_runtime(artifact, source), source.unet_config(), dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    if scheduler:
        set_scheduler(pipe, scheduler)
    return pipe


def _as_artifact(engine: str | os.PathLike[str] | Artifact | CompileResult) -> Artifact:
    if isinstance(engine, Artifact):
        return engine
    if isinstance(engine, str | os.PathLike):
        return Artifact.open(Path(engine))
    return engine.final  # a CompileResult: the artifact a runtime loads


def with_unet(pipe: Any, unet: torch.nn.Module) -> Any:
    """The same pipeline (shared components) with another UNet.

    Built through the constructor, not by assigning ``pipe.unet``: pipelines derive state from
    their UNet's config in ``__init__`` (e.g. whether ``sample_size`` is an int).
    """
    replaced = type(pipe)(**pipe.components | {"unet": unet}, requires_safety_checker=False)
    replaced.set_progress_bar_config(disable=True)
    return replaced


def generate(
    pipe: Any, request: GenerateRequest, on_step: Callable[[int, int], None] | None = None, output_type: str = "pil"
) -> Any:
    """Run the pipeline once; ``on_step(step_index, total_steps)`` is called after every denoising step.

    The total comes from the scheduler: some (PNDM) run more UNet steps than ``request.steps``.
    """

    def callback(_pipe: Any, step: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if on_step is not None:
            on_step(step, len(_pipe.scheduler.timesteps))
        return kwargs

    request = request.sized_for(SizeRule.for_unet(pipe.unet.config, pipe.vae_scale_factor))
    with torch.no_grad():
        return pipe(**request.pipeline_kwargs(), output_type=output_type, callback_on_step_end=callback)
