"""Step caches at the command line: `calibrate-cache`, and how a cached run compared with the uncached one reads."""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.config import CACHE_SETTINGS, CALIBRATION_PROMPTS, CacheCalibrationConfig
from ..core.errors import ConfigError, RequestError
from ..core.progress import results
from ..pipeline.request import check_scheduler
from ..spec import denoiser_component
from . import request_options, store_options

PROFILE_OPTIMUM = "the engines' profile optimum"


def register(app: typer.Typer) -> None:
    app.command(name="calibrate-cache")(calibrate_cache_command)


def calibrate_cache_command(
    engine: Annotated[str, typer.Option(help=f"{store_options.ENGINE_HELP} (compiled with --caches).")],
    cache: Annotated[
        str | None,
        typer.Option(
            help=f"The step cache whose setting to search: {', '.join(CACHE_SETTINGS)} (default: first-block for a "
            "transformer, deepcache for a UNet)."
        ),
    ] = None,
    min_psnr: Annotated[
        float, typer.Option(help="The quality target: each prompt's cached image against the uncached one, in dB.")
    ] = CacheCalibrationConfig.min_psnr_db,
    steps: request_options.StepsOpt = CacheCalibrationConfig.steps,
    scheduler: request_options.SchedulerOpt = None,
    prompts: Annotated[
        int, typer.Option(min=1, max=len(CALIBRATION_PROMPTS), help="How many of sdtrt's calibration prompts.")
    ] = len(CacheCalibrationConfig.prompts),
    height: Annotated[int | None, typer.Option(help=f"Image height in pixels (default: {PROFILE_OPTIMUM}).")] = None,
    width: Annotated[int | None, typer.Option(help=f"Image width in pixels (default: {PROFILE_OPTIMUM}).")] = None,
    model: store_options.EngineModelOpt = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Find the most aggressive setting of a step cache that keeps a quality target on an engine set, and store it
    beside the set for `--cache auto` (generate, validate) at the same steps and scheduler.

    The settings are tried from the most cautious (First-Block Cache: thresholds 0.02 … 0.8; MagCache: 0.02 … 0.8;
    TaylorSeer, DeepCache: intervals 2 … 8); each prompt's cached image is compared with the uncached engine
    pipeline's, same seed. With several calibrations of one set at the same steps, name the kind: --cache auto:KIND.

    Example: sdtrt calibrate-cache --engine engines/set/<key> --cache first-block --min-psnr 30 --steps 28
    """
    from ..tools.cache_calibration import calibrate_step_cache

    artifact = store_options.find_engine(engine, engines)
    source = store_options.model_for(model, artifact)
    cache = cache or ("deepcache" if denoiser_component(source) == "unet" else "first-block")
    try:
        config = CacheCalibrationConfig(
            cache, min_psnr, steps, scheduler, CALIBRATION_PROMPTS[:prompts], height, width
        )  # fmt: skip
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    if scheduler:
        check_scheduler(scheduler, source.family(), source.pipeline_class())
    request_options.resolve_cache(f"{cache}:{CACHE_SETTINGS[cache][0]:g}", artifact, source, steps, scheduler)
    calibration = calibrate_step_cache(source, artifact, config)
    for row in calibration.manifest["tried"]:
        psnr = "unchanged" if row["min_psnr_db"] is None else f"{row['min_psnr_db']:.1f} dB"
        skipped = "?" if row["skipped_share"] is None else f"{row['skipped_share']:.0%}"
        results.print(f"--cache {row['cache']}: worst image {psnr}, skipped {skipped} of the steps")
    chosen = calibration.manifest["cache"]
    if chosen is None:
        raise RequestError(f"no setting of {cache} kept {min_psnr:g} dB; lower --min-psnr or run without a cache")
    results.print(f"chosen: --cache {chosen} (stored: --cache auto uses it at {steps} steps)")
    typer.echo(calibration.path)


def cache_comparison_line(backend: str, cached: dict) -> str:
    """One backend's step-cache comparison, for people."""
    from rich.markup import escape

    if "error" in cached:  # the error names the --cache it refuses
        return f"[yellow]{backend}:[/] {escape(cached['error'])}"
    full = cached["full_evaluations"]
    psnr = "unchanged" if cached["psnr_db"] is None else f"PSNR {cached['psnr_db']:.1f} dB"
    evaluations = f"{full}/{cached['denoiser_calls']} full evaluations, " if full is not None else ""
    return (
        f"{backend} --cache {cached['cache']}: {evaluations}denoising loop {cached['denoise_loop_s']['median']:.3f} s "
        f"→ {cached['cached_denoise_loop_s']['median']:.3f} s ({cached['speedup']:.2f}×); against the uncached "
        f"image {psnr}, SSIM {cached['ssim']:.4f}"
        + (f", LPIPS {cached['lpips']:.4f}" if "lpips" in cached else "")
        + (f", CLIP score {cached['clip_score']:.2f} (uncached {cached['reference_clip_score']:.2f})"
           if "clip_score" in cached else "")
    )  # fmt: skip
