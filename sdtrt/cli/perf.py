"""``sdtrt bench`` and ``sdtrt profile``: where the time goes, per backend and per step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from ..core.config import BENCH_BACKENDS, BenchConfig, Precision
from ..core.errors import ConfigError, RequestError
from ..core.progress import console, results, step
from ..pipeline.request import GenerateRequest
from ..pipeline.step_cache import model_problem
from . import request_options, result_files, store_options
from .step_cache import cache_comparison_line


def register(app: typer.Typer) -> None:
    app.command()(bench)
    app.command(name="profile")(profile_command)


def bench(
    model: store_options.ModelOpt = "tiny",
    backends: Annotated[
        str, typer.Option(help=f"Comma-separated, in order: {','.join(BENCH_BACKENDS)}.")
    ] = "torch,onnxruntime",
    steps: request_options.StepsOpt = 20,
    batch: Annotated[int, typer.Option(min=1, help="Images per prompt (the UNet sees twice as many).")] = 1,
    height: request_options.HeightPxOpt = None,
    width: request_options.WidthPxOpt = None,
    image: request_options.ImageOpt = None,
    mask: request_options.MaskOpt = None,
    task: request_options.TaskOpt = None,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed runs per backend before the timed ones.")] = 1,
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per backend.")] = 3,
    precision: Annotated[Precision, typer.Option(help="Engines' graph precision where a backend names none.")] = "fp16",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the full results (documented format).")] = None,
    time_file: Annotated[Path | None, typer.Option(help="Write '<backend> <median seconds>' lines.")] = None,
    chart: Annotated[Path | None, typer.Option(help="Write a PNG bar chart of the breakdown.")] = None,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            metavar=request_options.LORA_METAVAR,
            help="A LoRA as FILE[:SCALE], put into every backend first (engine builds: refittable); "
            "reports how long that and a swap take. Repeat for several.",
        ),
    ] = None,
    cache: request_options.CacheOpt = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Time whole generations per backend, side by side, broken down by stage.

    With --cache, each backend also runs the step cache, alternating with uncached runs, and reports both denoising
    loops, their ratio, the full evaluations the cache left and its image's PSNR/SSIM against the uncached one.

    Example: sdtrt bench --model tiny --backends torch,onnxruntime --steps 4 --repeats 3 --json b.json --chart b.png
    Image to image, inpainting, editing: --task img2img --image photo.png (--task inpaint … --mask mask.png; a
    Qwen-Image-Edit or FLUX.1 Kontext model's own task takes --image alone)
    """
    from ..sources.models import resolve_model

    chosen = request_options.task_option(task)
    inputs = request_options.task_images(image, mask)
    loras = tuple(request_options.lora_options(lora))
    if cache is not None and cache.startswith("auto"):
        raise RequestError(
            "bench compiles its own engines, which have no calibration: give the cache's setting, or time a calibrated "
            "set (a quantized one too) with `sdtrt validate --engine SET --cache auto`"
        )
    step_cache = request_options.step_cache(cache)  # a malformed --cache is a usage error before anything loads
    try:  # backends and their precisions: a usage error before anything loads
        config = BenchConfig(
            backends=tuple(b.strip() for b in backends.split(",") if b.strip()), steps=steps, batch=batch,
            height=height, width=width, warmup=warmup, repeats=repeats, precision=precision, loras=loras, cache=cache,
            task=chosen,
        )  # fmt: skip
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    source = resolve_model(model)
    request_options.check_lora_families(list(loras), source)
    # the images the task's pipeline takes, and the size (an SD img2img image's own): before torch loads
    sized = request_options.checked_request(GenerateRequest(height=height, width=width, **inputs), source, chosen, None)
    config = dataclasses.replace(config, height=sized.height, width=sized.width)
    if step_cache is not None and (problem := model_problem(step_cache, source, source.name)):
        raise RequestError(problem)
    for path, option in ((json_out, "--json"), (time_file, "--time-file"), (chart, "--chart")):
        result_files.ensure_parent(path, option)
    from ..tools.bench import check_engines_ran, run_bench, write_chart

    report = run_bench(
        source, config, store_options.open_store(engines), on_backend=lambda name: console.print(f"[bold]{name}[/]…"),
        inputs={name: value for name, value in inputs.items() if value is not None},
    )  # fmt: skip
    print_bench(report)
    if json_out:
        json_out.write_text(json.dumps(report, indent=2))
    if time_file:
        lines = [f"{b['name']} {b['total_s']['median']:.6f}" for b in report["backends"] if b["status"] == "ok"]
        time_file.write_text("\n".join(lines) + "\n")
    if chart:
        write_chart(report, chart)
        console.print(f"chart: {chart}")
    check_engines_ran(report)


def _cell(stats: dict[str, float] | None) -> str:
    return f"{stats['median']:.3f}" if stats else "–"


def print_bench(report: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..tools.bench import NOISY_RATIO, denoiser_label

    cfg = report["config"]
    table = Table(
        title=f"{cfg['model']}: {cfg['steps']} steps, batch {cfg['batch']}, median of {cfg['repeats']} "
        f"(seconds; {report['environment']['device']})",
        title_justify="left",
    )
    unet = denoiser_label(cfg.get("denoiser", "unet"))
    columns = ["backend", "load", "total", "min–max", "text enc", "denoise", unet, f"{unet}/call ms", "sched+guid",
               "VAE", "RSS MB", "speed-up"]  # fmt: skip
    for c in columns:
        table.add_column(c, justify="left" if c == "backend" else "right")
    for b in report["backends"]:
        if b["status"] != "ok":
            table.add_row(b["name"], f"[yellow]{b['status']}[/]", *[""] * (len(columns) - 2))
            continue
        s = b["stages_s"]
        table.add_row(
            b["name"], f"{b['load_s']:.1f}", _cell(b["total_s"]),
            f"{b['total_s']['min']:.3f}–{b['total_s']['max']:.3f}",
            _cell(s["text_encoder"]), _cell(s["denoise_loop"]), _cell(s["unet"]), f"{b['unet_call_ms']['median']:.1f}",
            _cell(s["scheduler_guidance"]), _cell(s["vae_decode"]), f"{b['peak_rss_mb']:.0f}",
            f"{b['speedup_vs_first']:.2f}x",
        )  # fmt: skip
    results.print(table)
    for b in report["backends"]:
        if b["status"] != "ok":
            results.print(f"[yellow]{b['name']} {b['status']}:[/] {escape(b['reason'])}")
    for b in report["backends"]:
        if b.get("lora_apply_s") is not None:
            swap = b["lora_swap_s"]
            swaps = f"; a swap {swap['median']:.3f} s (median, {swap['min']:.3f}–{swap['max']:.3f})" if swap else ""
            results.print(f"{b['name']} LoRAs: first {b['lora_apply_s']:.3f} s{swaps}")
    for b in report["backends"]:
        if cached := b.get("step_cache"):
            results.print(cache_comparison_line(b["name"], cached))
    noisy = [b["name"] for b in report["backends"] if b.get("noisy")]
    if noisy:
        results.print(
            f"[yellow]noisy:[/] {', '.join(noisy)}: the slowest run took over {NOISY_RATIO}× the fastest (a busy "
            "machine?); do not read speed-ups from these rows — rerun with more --repeats on an idle machine"
        )


def profile_command(
    out: Annotated[Path, typer.Option(help="Folder for trace.json, flame.speedscope.json and steps.json.")],
    model: store_options.EngineModelOpt = None,
    engine: store_options.EngineOpt = None,
    trace: Annotated[
        list[str] | None, typer.Option(help="Function or method to wrap in spans, as package.module.Class.method.")
    ] = None,
    steps: request_options.StepsOpt = 20,
    height: request_options.HeightPxOpt = None,
    width: request_options.WidthPxOpt = None,
    image: request_options.ImageOpt = None,
    mask: request_options.MaskOpt = None,
    task: request_options.TaskOpt = None,
    warmup: Annotated[int, typer.Option(min=0, help="Untraced generations first (0: see first-run effects).")] = 0,
    prompt: Annotated[str, typer.Option(help="What to draw.")] = GenerateRequest.prompt,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Trace one generation: waterfall (trace.json), flame graph, per-step table with outliers.

    Example: sdtrt profile --model tiny --out prof --trace diffusers.schedulers.scheduling_pndm.PNDMScheduler.step
    Image to image, inpainting, editing: --task img2img --image photo.png (--task inpaint … --mask mask.png)
    """
    result_files.check_folder(out, "--out")
    chosen = request_options.task_option(task)
    artifact = store_options.find_engine(engine, engines) if engine else None
    source = store_options.model_for(model, artifact)
    images = request_options.task_images(image, mask)
    request = GenerateRequest(prompt=prompt, steps=steps, height=height, width=width, **images)
    request = request_options.checked_request(request, source, chosen, artifact)

    from rich.table import Table

    from ..spec import denoiser_component
    from ..tools.bench import denoiser_label
    from ..tools.profile import OUTLIER_FACTOR, profile_generation

    with step("Profiling one generation"):
        result = profile_generation(
            source, artifact, out,
            request, tuple(trace or ()), warmup=warmup, task=chosen,
        )  # fmt: skip
    unet = denoiser_label(denoiser_component(source))
    table = Table(title=f"per step (outlier: > {OUTLIER_FACTOR}× the median)", title_justify="left")
    for c in ("step", "timestep", "ms", f"{unet} ms", "other ms", "syncs", ""):
        table.add_column(c, justify="right")
    for r in result.steps:
        table.add_row(
            str(r.index), f"{r.timestep:g}" if r.timestep is not None else "–", f"{r.seconds * 1e3:.1f}",
            f"{r.unet_seconds * 1e3:.1f}", f"{(r.seconds - r.unet_seconds) * 1e3:.1f}",
            "n/a (CPU)" if r.syncs is None else str(r.syncs), "[red]outlier[/]" if r.outlier else "",
        )  # fmt: skip
    results.print(table)
    traced = {name: sum(1 for s in result.spans if s.name == name) for name in trace or ()}
    for name, count in traced.items():
        console.print(f"traced {name}: {count} calls")
    console.print(f"flame graph: {result.flame} (open in https://www.speedscope.app)")
    typer.echo(result.trace)
