"""A step cache measured the way the field does: the cached and the uncached pipeline side by side in one run.

Per image: the denoiser's calls and its full evaluations (a transformer's steps whose blocks after the first ran, a
UNet's deep passes), the denoising loop's median seconds and their ratio, and the cached image against the uncached
one (same seed): PSNR and SSIM; LPIPS and both images' CLIP scores where their weights are on this machine
(image_quality.perceptual_scores says why where not).
Runs alternate (uncached, cached, uncached, …) so that a machine growing busier weighs on both alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..core.artifact import Artifact
from ..core.config import ValidationConfig
from ..pipeline.loading import generate, load_pipeline
from ..pipeline.request import GenerateRequest, SizeRule
from ..pipeline.step_cache import StepCache, disable_step_cache, enable_step_cache, split_calls
from ..sources.models import ModelSource
from .image_quality import perceptual_scores, psnr_db, ssim
from .timing import Stats
from .trace import Tracer, breakdown, instrument_pipeline


def _timed_run(pipe: Any, request: GenerateRequest) -> tuple[np.ndarray, float, int, int | None]:
    """One generation: its image, denoising-loop seconds, transformer calls and full evaluations."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tracer = Tracer(device)
    before = split_calls(pipe)
    with instrument_pipeline(pipe, tracer) as steps, tracer.span("pipeline", "pipeline"):
        image = generate(pipe, request, on_step=steps.step_ended, output_type="np").images
    spans = tracer.spans()
    after = split_calls(pipe)
    full = None if before is None or after is None else after[0] - before[0]
    return image, breakdown(spans)["denoise_loop"], sum(s.category == "unet" for s in spans), full


def compare_step_cache(pipe: Any, request: GenerateRequest, cache: StepCache, repeats: int) -> dict[str, Any]:
    """The uncached and the ``cache``d runs of ``request`` on ``pipe``, ``repeats`` each, alternating (JSON-ready)."""
    uncached_s, cached_s = [], []
    for _ in range(repeats):
        reference, seconds, calls, _ = _timed_run(pipe, request)
        uncached_s.append(seconds)
        enable_step_cache(pipe, cache, request.steps)
        try:
            image, seconds, _, full = _timed_run(pipe, request)
        finally:
            disable_step_cache(pipe)
        cached_s.append(seconds)
    loop, cached_loop = Stats.of(uncached_s).median, Stats.of(cached_s).median
    return {
        "cache": cache.label,
        "denoiser_calls": calls,
        "full_evaluations": full,  # None on PyTorch, whose hooks count nothing sdtrt reads
        "skipped_share": None if full is None else round(1 - full / calls, 4),
        "denoise_loop_s": Stats.of(uncached_s).to_json(),
        "cached_denoise_loop_s": Stats.of(cached_s).to_json(),
        "speedup": round(loop / cached_loop, 3),
        "psnr_db": None if math.isinf(psnr := psnr_db(image, reference)) else round(psnr, 2),  # None: equal images
        "ssim": round(ssim(image, reference), 4),
    } | perceptual_scores(image, reference, request.prompt)


def compare_on_engines(
    model: ModelSource, engine: Artifact, cache: StepCache, config: ValidationConfig
) -> dict[str, Any]:
    """``compare_step_cache`` once on the engine pipeline, at validation's steps, scheduler and size (default: the
    engines' profile optimum, as validation's image comparison)."""
    from ..stages.engine_set import engine_members, engine_profile

    profile = engine_profile(engine_members(engine))
    height = config.height or (profile.height.opt if profile else None)
    width = config.width or (profile.width.opt if profile else None)
    request = GenerateRequest(steps=config.steps, height=height, width=width).sized_for(SizeRule.for_model(model))
    pipe = load_pipeline(model, engine, scheduler=config.scheduler)
    return compare_step_cache(pipe, request, cache, repeats=1)
