"""Step caches on engines, measured side by side in one run: what they skip, what that saves, what it costs.

    python benchmarks/step_cache.py                                  # the tiny presets, 512 px (~10 min on 2 cores)
    python benchmarks/step_cache.py --models tiny-flux --size 1024 --repeats 3

Per model (an fp32 ONNX Runtime engine set compiled with its --caches), in one process:
1. **The split's price**: the uncached loop on the whole engine against the same loop with the cache on but skipping
   nothing (First-Block Cache at threshold 0, DeepCache at interval 1): the chain of split members on every step.
2. **Each cache**: full evaluations left, the denoising loop uncached → cached and the speed-up, against ``ideal``:
   the uncached loop less what the skipped work costs, from each split member's measured seconds per call (a step
   First-Block Cache skips saves the other blocks' engine; one MagCache skips the first block's too; a predicted
   TaylorSeer step saves all but the embedders; a DeepCache step trades the deep pass for the shallow one).
   ``speedup/ideal`` near 1 says the split eats none of the gain; under 1, the chain's extra engine calls do.
   And the cached image against the uncached one (PSNR, SSIM).
Results go to --json; a line per setting is printed. Steps: each family's usual (28 Flux dev and SD3, 4 schnell,
50 SD 1.x).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path

STEPS = {"tiny-flux": 28, "tiny-flux-schnell": 4, "tiny-sd3": 28, "tiny": 50, "mid-flux": 28}
# Between the tiny presets (two blocks: the embedders and head weigh as much as a block) and the *-random ones (minutes
# per step on a CPU): Flux dev's layout, 2 double-stream + 8 single-stream blocks of 4 heads × 64, random weights.
MID_FLUX = {"num_layers": 2, "num_single_layers": 8, "attention_head_dim": 64, "num_attention_heads": 4,
            "axes_dims_rope": (8, 28, 28)}  # fmt: skip
CACHES = {
    "transformer": ("first-block:0", "first-block:0.1", "first-block:0.3", "taylorseer:3", "magcache:0.3"),
    "unet": ("deepcache:1", "deepcache:2", "deepcache:3", "deepcache:5"),
}


def timed_members(split) -> dict[str, list[float]]:
    """Wrap each split member's runtime so every call's seconds are recorded, by member."""
    seconds: dict[str, list[float]] = defaultdict(list)
    for name, part in vars(split).items():
        runtime = getattr(part, "runtime", None)
        if runtime is None:
            continue

        def timed(feeds, run=runtime.run, name=name):
            started = time.perf_counter()
            out = run(feeds)
            seconds[name].append(time.perf_counter() - started)
            return out

        runtime.run = timed
    return seconds


def mid_flux(folder: Path) -> Path:
    """The mid-size Flux model's folder, built once (seeded random weights, the tiny preset's encoders and VAE)."""
    from sdtrt.sources.preset_build import build
    from sdtrt.sources.presets import PRESETS

    if not (folder / "model_index.json").is_file():
        tiny = PRESETS["tiny-flux"]
        transformer = (tiny.denoiser[0], {**tiny.denoiser[1], **MID_FLUX})
        build(dataclasses.replace(tiny, denoiser=transformer)).save_pretrained(folder, safe_serialization=True)
    return folder


def bench_model(name: str, size: int, steps: int, repeats: int, engines: str) -> list[dict]:
    import sdtrt
    from sdtrt.core.config import ExportConfig, ShapeProfile
    from sdtrt.core.store import Store
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.pipeline.step_cache import StepCache, disable_step_cache, enable_step_cache
    from sdtrt.sources.models import models_cache_dir, resolve_model
    from sdtrt.spec import denoiser_component, denoiser_spec
    from sdtrt.tools.step_cache_bench import compare_step_cache

    model = resolve_model(name if name != "mid-flux" else str(mid_flux(models_cache_dir() / "bench-mid-flux")))
    denoiser = denoiser_component(model)
    spec = denoiser_spec(model)
    default = spec.default_profile()
    around = ShapeProfile.around(size, spec.pixel_multiple)
    profile = ShapeProfile(default.batch, around.height, around.width, default.guidance, default.tokens)
    caches = ("first-block",) if denoiser == "transformer" else ("deepcache",)
    result = sdtrt.compile_model(
        model, Store(engines), "onnxruntime", ExportConfig(precision="fp32"), profile=profile, caches=caches
    )
    pipe = sdtrt.load_pipeline(model, result.final)
    request = GenerateRequest(steps=steps, height=size, width=size)
    first = StepCache.parse(CACHES[denoiser][1])
    enable_step_cache(pipe, first, steps)  # opens the split members, to time them
    disable_step_cache(pipe)
    split = getattr(pipe, denoiser).split
    seconds = timed_members(split)
    rows, settings = [], [c for c in CACHES[denoiser] if not (c.startswith("magcache") and "flux" not in name)]
    for label in settings:
        kind, _, value = label.partition(":")
        cache = StepCache(kind, float(value))  # type: ignore[arg-type]  # 0 and 1: the chain, skipping nothing
        calls_before = {member: len(times) for member, times in seconds.items()}
        row = compare_step_cache(pipe, request, cache, repeats)
        calls = {member: (len(times) - calls_before.get(member, 0)) / repeats for member, times in seconds.items()}
        per_call = {member: sum(times) / len(times) for member, times in seconds.items() if times}
        # Calls each member makes when nothing is skipped: a transformer's every part, a UNet's deep pass, per step.
        baseline = {member: 0 if member == "shallow" else row["denoiser_calls"] for member in per_call}
        saved = sum((baseline[m] - calls.get(m, 0)) * per_call[m] for m in per_call)
        loop = row["denoise_loop_s"]["median"]
        row["ideal_speedup"] = round(loop / max(loop - saved, 1e-9), 3)
        row["speedup_vs_ideal"] = round(row["speedup"] / row["ideal_speedup"], 3)
        row["member_call_ms"] = {m: round(t * 1000, 3) for m, t in per_call.items()}
        rows.append({"model": name, "size": size, "steps": steps} | row)
        psnr = "unchanged" if row["psnr_db"] is None else f"{row['psnr_db']:.1f} dB"
        print(
            f"{name} {label:>16}: {row['full_evaluations']:>2}/{row['denoiser_calls']} full, loop "
            f"{loop:.3f} → {row['cached_denoise_loop_s']['median']:.3f} s = {row['speedup']:.2f}× (ideal "
            f"{row['ideal_speedup']:.2f}×, ratio {row['speedup_vs_ideal']:.2f}), {psnr}, SSIM {row['ssim']:.4f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-flux,tiny-flux-schnell,tiny-sd3,tiny")
    parser.add_argument("--size", type=int, default=512, help="Image size in pixels.")
    parser.add_argument("--steps", type=int, default=0, help="Denoising steps (0: each family's usual).")
    parser.add_argument("--repeats", type=int, default=3, help="Alternating uncached/cached runs per setting.")
    parser.add_argument("--engines", default="engines")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/step-cache.json"))
    args = parser.parse_args()
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, args.size, args.steps or STEPS.get(name, 28), args.repeats, args.engines)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
