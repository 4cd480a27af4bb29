"""Step caches on engines, measured side by side in one run: what they skip, what that saves, what it costs.

    python benchmarks/step_cache.py                                   # the tiny presets (~3 min on 2 cores)
    python benchmarks/step_cache.py --models sd35-medium-random --size 512 --steps 28 --repeats 1   # full-size SD3.5

Per model (an fp32 ONNX Runtime engine set compiled with --caches first-block), in one process:
1. **The split's price**: the uncached loop on the whole-transformer engine against the same loop chained through the
   four part engines with nothing skipped (First-Block Cache at threshold 0): the ``chain/whole`` ratio.
2. **Each cache** (First-Block Cache at two thresholds, TaylorSeer lite, MagCache on Flux): full evaluations left,
   denoising loop uncached → cached and the speed-up, against the speed-up the skipped blocks alone would give
   (``ideal``: the uncached loop less the other-blocks engine's measured time per skipped step), and the cached image
   against the uncached one (PSNR, SSIM). ``speedup/ideal`` near 1 says the split eats none of the gain.
Results go to --json; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

STEPS = {"tiny-flux": 28, "tiny-flux-schnell": 4, "tiny-sd3": 28, "sd35-medium-random": 28, "flux-random": 28}
CACHES = ("first-block:0.1", "first-block:0.3", "taylorseer:3", "magcache:0.3")


def timed_rest(pipe):
    """Wrap the other-blocks engine's runtime so each call's seconds are recorded (the list it appends to)."""
    runtime = pipe.transformer.split.rest.runtime
    seconds, run = [], runtime.run

    def timed(feeds):
        started = time.perf_counter()
        out = run(feeds)
        seconds.append(time.perf_counter() - started)
        return out

    runtime.run = timed
    return seconds


def bench_model(name: str, size: int, steps: int, repeats: int, engines: str) -> list[dict]:
    import sdtrt
    from sdtrt.core.config import ExportConfig, ShapeProfile
    from sdtrt.core.store import Store
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.pipeline.step_cache import StepCache
    from sdtrt.sources.models import resolve_model
    from sdtrt.spec import denoiser_spec
    from sdtrt.tools.step_cache_bench import compare_step_cache

    model = resolve_model(name)
    spec = denoiser_spec(model)
    default = spec.default_profile()
    profile = ShapeProfile.around(size, spec.pixel_multiple) if size else default
    profile = ShapeProfile(default.batch, profile.height, profile.width, default.guidance, default.tokens)
    result = sdtrt.compile_model(
        model, Store(engines), "onnxruntime", ExportConfig(precision="fp32"), profile=profile, caches=("first-block",)
    )
    pipe = sdtrt.load_pipeline(model, result.final)
    request = GenerateRequest(steps=steps, height=size or None, width=size or None)
    rest_seconds = timed_rest(pipe)
    rows = []
    for label in ("first-block:0", *CACHES):
        if label.startswith("magcache") and "flux" not in name:
            continue  # diffusers publishes magnitude ratios for Flux only
        kind, _, value = label.partition(":")
        cache = StepCache(kind, float(value)) if value == "0" else StepCache.parse(label)  # type: ignore[arg-type]
        rest_seconds.clear()
        row = compare_step_cache(pipe, request, cache, repeats)
        per_rest = sum(rest_seconds) / len(rest_seconds) if rest_seconds else 0.0
        loop = row["denoise_loop_s"]["median"]
        skipped = row["denoiser_calls"] - row["full_evaluations"]
        row["ideal_speedup"] = round(loop / max(loop - skipped * per_rest, 1e-9), 3)
        row["speedup_vs_ideal"] = round(row["speedup"] / row["ideal_speedup"], 3)
        row["rest_call_s"] = round(per_rest, 5)
        rows.append({"model": name, "size": size, "steps": steps} | row)
        print(
            f"{name} {label:>16}: {row['full_evaluations']:>2}/{row['denoiser_calls']} full, loop "
            f"{loop:.3f} → {row['cached_denoise_loop_s']['median']:.3f} s = {row['speedup']:.2f}× (ideal "
            f"{row['ideal_speedup']:.2f}×, ratio {row['speedup_vs_ideal']:.2f}), PSNR {row['psnr_db']:.1f} dB, "
            f"SSIM {row['ssim']:.4f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-flux,tiny-flux-schnell,tiny-sd3")
    parser.add_argument("--size", type=int, default=512, help="Image size in pixels (0: the model's default).")
    parser.add_argument("--steps", type=int, default=0, help="Denoising steps (0: each family's usual: 28, or 4).")
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
