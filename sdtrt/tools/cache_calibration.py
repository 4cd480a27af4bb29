"""`calibrate-cache`: the most aggressive step-cache setting that keeps a quality target, stored with the engine set.

A cache's threshold depends on the model, the scheduler, the step count and the precision (ParaAttention finds FP8
needs 0.12 where bf16 needs 0.08), so the search runs on the engine set itself: the settings of CACHE_SETTINGS are
tried from the most cautious, each prompt's cached image against the uncached engine pipeline's (same seed), until
the worst image falls under the target PSNR. The result is an artifact of the store whose input is the set (its key
changes with any member, a quantized one included); ``--cache auto`` finds it (``find_calibration``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import CACHE_SETTINGS, CacheCalibrationConfig
from ..core.errors import ArtifactNotFoundError
from ..core.progress import step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..pipeline.loading import generate, load_pipeline
from ..pipeline.request import GenerateRequest, SizeRule
from ..pipeline.step_cache import StepCache, disable_step_cache, enable_step_cache, split_calls
from ..sources.models import ModelSource
from ..stages.engine_set import engine_members, engine_profile
from .image_quality import psnr_db, ssim

STAGE = "calibrate-cache"
VERSION = 1


def calibrate_step_cache(model: ModelSource, engine: Artifact, config: CacheCalibrationConfig) -> Artifact:
    """The search for ``engine`` (a set compiled with caches), stored beside it; a cache hit when it ran before."""
    request = StageRequest(STAGE, VERSION, config, [engine.as_input()], environment("diffusers"))
    artifact, built = engine_store(engine).produce(request, lambda out_dir: _search(model, engine, config, out_dir))
    if not built:  # asked again: it is the newest calibration now, the one --cache auto reads
        os.utime(artifact.path / "manifest.json")
    return artifact


def settings_for(config: CacheCalibrationConfig) -> tuple[float, ...]:
    """The settings worth trying: an interval of the whole run or more would never compute a step after the first."""
    intervals = config.kind in ("taylorseer", "deepcache")
    return tuple(v for v in CACHE_SETTINGS[config.kind] if not (intervals and v >= config.steps))


def _requests(model: ModelSource, engine: Artifact, config: CacheCalibrationConfig) -> list[GenerateRequest]:
    profile = engine_profile(engine_members(engine))
    height = config.height or (profile.height.opt if profile else None)
    width = config.width or (profile.width.opt if profile else None)
    rule = SizeRule.for_model(model)
    return [
        GenerateRequest(prompt=p, steps=config.steps, seed=config.seed, height=height, width=width).sized_for(rule)
        for p in config.prompts
    ]


def _search(model: ModelSource, engine: Artifact, config: CacheCalibrationConfig, out_dir: Path) -> dict[str, Any]:
    import json

    pipe = load_pipeline(model, engine, scheduler=config.scheduler)
    requests = _requests(model, engine, config)
    with step(f"Generating {len(requests)} uncached reference images ({config.steps} steps)"):
        references = [generate(pipe, r, output_type="np").images for r in requests]
    tried, chosen = [], None
    for value in settings_for(config):
        cache = StepCache(config.kind, value)  # type: ignore[arg-type]  # CacheCalibrationConfig checked the kind
        with step(f"Trying --cache {cache.label}"):
            enable_step_cache(pipe, cache, config.steps)
            try:
                before = split_calls(pipe) or (0, 0)
                images = [generate(pipe, r, output_type="np").images for r in requests]
                after = split_calls(pipe) or (0, 0)
            finally:
                disable_step_cache(pipe)
            full, steps = after[0] - before[0], after[1] - before[1]  # steps: Heun's are two calls
        worst = min(psnr_db(i, r) for i, r in zip(images, references, strict=True))
        row = {
            "cache": cache.label,
            "min_psnr_db": round(worst, 2) if math.isfinite(worst) else None,  # None: every image unchanged
            "min_ssim": round(min(ssim(i, r) for i, r in zip(images, references, strict=True)), 4),
            "skipped_share": round(1 - full / steps, 4) if steps else None,
        }
        tried.append(row)
        if worst < config.min_psnr_db:
            break
        chosen = row
    (out_dir / "calibration.json").write_text(json.dumps({"chosen": chosen, "tried": tried}, indent=2))
    return {
        "primary": "calibration.json",
        "cache": chosen["cache"] if chosen else None,
        "chosen": chosen,
        "tried": tried,
        "reproduce": f"sdtrt calibrate-cache --engine {engine.path} --cache {config.kind} --min-psnr "
        f"{config.min_psnr_db:g} --steps {config.steps}"
        + (f" --scheduler {config.scheduler}" if config.scheduler else ""),
    }


def engine_store(engine: Artifact) -> Store:
    """The store ``engine`` lives in, where its calibrations go beside it."""
    return Store(engine.path.parents[1])


def find_calibrations(engine: Artifact, steps: int, scheduler: str | None, kind: str | None) -> list[Artifact]:
    """The calibrations of ``engine`` at ``steps`` steps with ``scheduler`` (None: the pipeline's own), of ``kind``
    (None: any)."""
    return [
        a for a in engine_store(engine).artifacts()
        if a.stage == STAGE and a.manifest["inputs"][0]["digest"] == engine.key
        and a.manifest["config"]["steps"] == steps and a.manifest["config"]["scheduler"] == scheduler
        and kind in (None, a.manifest["config"]["kind"])
    ]  # fmt: skip


def auto_cache(engine: Artifact, steps: int, scheduler: str | None, kind: str | None = None) -> StepCache:
    """``--cache auto[:KIND]``: the setting the newest ``calibrate-cache`` run (of ``kind``) stored for this engine set,
    steps and scheduler (a run asked again, a cache hit, counts as the newest)."""
    found = find_calibrations(engine, steps, scheduler, kind)
    again = f"sdtrt calibrate-cache --engine {engine.path} --steps {steps} --cache {kind or '<KIND>'}" + (
        f" --scheduler {scheduler}" if scheduler else ""
    )
    if not found:
        raise ArtifactNotFoundError(
            f"--cache auto: no calibration of {engine.path} at {steps} steps; run `{again}` first"
        )
    calibration = max(found, key=lambda a: (a.path / "manifest.json").stat().st_mtime)
    if calibration.manifest["cache"] is None:
        target = calibration.manifest["config"]["min_psnr_db"]
        raise ArtifactNotFoundError(
            f"--cache auto: the newest calibration of {engine.path} ({calibration.path}) found no setting that kept "
            f"{target:g} dB; run without a cache, or `{again} --min-psnr <lower>`"
        )
    return StepCache.parse(calibration.manifest["cache"])
