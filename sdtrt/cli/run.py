"""Commands that use an engine: generate images, validate against PyTorch.

Every value is checked (image size against the model, seed, scheduler) before a model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from ..core.config import ValidationConfig
from ..core.errors import RequestError
from ..core.progress import console, counted_steps, results, step
from ..pipeline.request import (
    GenerateRequest,
    SizeRule,
    check_prompt_tokens,
    check_scheduler,
    check_validation,
)
from . import graph_options, request_options, result_files, store_options
from .report import ReportOpt, write_validation_report
from .step_cache import cache_comparison_line

if TYPE_CHECKING:
    from ..tools.block_parity import BlockParityReport
    from ..tools.validate import ValidationReport


def register(app: typer.Typer) -> None:
    app.command(name="generate")(generate_command)
    app.command(name="validate")(validate_command)
    app.command(name="check-blocks")(check_blocks_command)


def generate_command(
    prompt: request_options.PromptOpt = GenerateRequest.prompt,
    model: store_options.EngineModelOpt = None,
    engine: store_options.EngineOpt = None,
    negative_prompt: request_options.NegativePromptOpt = None,
    steps: request_options.StepsOpt = GenerateRequest.steps,
    guidance: request_options.GuidanceOpt = GenerateRequest.guidance,
    seed: request_options.SeedOpt = GenerateRequest.seed,
    height: request_options.HeightPxOpt = None,
    width: request_options.WidthPxOpt = None,
    scheduler: request_options.SchedulerOpt = None,
    image: request_options.ImagesOpt = None,
    mask: request_options.MaskOpt = None,
    control_image: request_options.ControlImageOpt = None,
    reference_image: request_options.ReferenceImageOpt = None,
    strength: request_options.StrengthOpt = None,
    task: request_options.TaskOpt = None,
    lora: Annotated[
        list[str] | None,
        typer.Option(
            metavar=request_options.LORA_METAVAR,
            help="A LoRA as FILE[:SCALE] (scale 1.0 by default); repeat for several. No rebuild.",
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Where to write the PNG.")] = Path("image.png"),
    weight_streaming_budget: request_options.WeightBudgetOpt = None,
    cache: request_options.CacheOpt = None,
    freeu: request_options.FreeUOpt = None,
    ip_adapter_image: Annotated[
        Path | None,
        typer.Option(help="An IP-Adapter's image, whose content guides the image: needs an --engine set compiled "
                     "with --ip-adapter."),
    ] = None,
    ip_adapter_scale: Annotated[
        float | None,
        typer.Option(help="How strongly --ip-adapter-image guides (set_ip_adapter_scale's float; 1 by default)."),
    ] = None,
    engines: store_options.EnginesOpt = None,
) -> None:  # fmt: skip
    """Generate an image with the model's own diffusers pipeline, its networks on an engine (or set).

    Example: sdtrt generate --engine engines/set/2a06c39aaf814d52 --prompt "a red fox" --lora style.safetensors:.8
    Inpainting: sdtrt generate --model tiny-inpaint --image photo.png --mask mask.png
    FLUX.1 Fill / Canny / Kontext: --image photo.png --mask mask.png; --control-image edges.png; --image reference.png
    Kontext inpainting: --task inpaint --image photo.png --mask mask.png (--reference-image other.png: its reference)
    Qwen-Image-Edit: --image photo.png --prompt "make it night" --negative-prompt " " --guidance 4 (2509: --image
    repeated, 1 to 3)
    Step caches: --cache first-block:0.5 or taylorseer:2 on a set compiled with --caches (FLUX.2: taylorseer)
    IP-Adapter: sdtrt generate --engine engines/set/… --ip-adapter-image style.png --ip-adapter-scale 0.6
    """
    from ..core.families import pipeline_class_name
    from ..stages.engine_set import engine_members, engine_profile

    chosen = request_options.task_option(task)
    loras = request_options.lora_options(lora)
    budget = request_options.weight_budget(weight_streaming_budget)
    request_options.step_cache(cache)  # a malformed --cache: exit 2 before anything loads
    result_files.ensure_image_file(out, "--out")
    artifact = store_options.find_engine(engine, engines) if engine else None
    source = store_options.model_for(model, artifact)
    request_options.check_lora_families(loras, source)
    request = GenerateRequest(
        prompt, negative_prompt, steps, guidance, seed, height, width, strength=strength,
        **request_options.task_images(image, mask, pipeline_class_name(source.pipeline_class(), chosen)),
        ip_adapter_image=request_options.open_image(ip_adapter_image, "RGB", "--ip-adapter-image"),
        control_image=request_options.open_image(control_image, "RGB", "--control-image"),
        image_reference=request_options.open_image(reference_image, "RGB", "--reference-image"),
    )  # fmt: skip
    if ip_adapter_image is not None:
        request_options.require_ip_adapter_engine(artifact)
    elif ip_adapter_scale is not None:
        raise RequestError("--ip-adapter-scale scales an --ip-adapter-image: pass one, or leave the scale out")
    request = request_options.checked_request(request, source, chosen, artifact)
    profile = engine_profile(engine_members(artifact)) if artifact else None
    if scheduler:
        check_scheduler(scheduler, source.family(), pipeline_class_name(source.pipeline_class(), chosen))
    # the cache's check reads configs alone; the prompt's loads the tokenizers (seconds of imports)
    step_cache = request_options.resolve_cache(cache, artifact, source, steps, scheduler, from_image=bool(image))
    check_prompt_tokens(source, request, profile)
    freeu_factors = request_options.freeu_factors(freeu, artifact, source)
    if freeu_factors is not None and step_cache is not None and step_cache.kind == "deepcache":
        raise RequestError("--freeu with --cache deepcache: DeepCache's members have no FreeU; use one of them")

    from ..pipeline.loading import generate, load_pipeline

    with step(f"Loading pipeline ({'engine ' + str(artifact.path) if artifact else 'PyTorch'})"):
        pipe = load_pipeline(source, artifact, scheduler=scheduler, task=chosen, loras=loras, weight_budget=budget)
    if freeu_factors is not None:
        pipe.enable_freeu(*freeu_factors)
    if ip_adapter_image is not None:
        pipe.set_ip_adapter_scale(1.0 if ip_adapter_scale is None else ip_adapter_scale)
    if step_cache is not None:
        from ..pipeline.step_cache import enable_step_cache, split_calls

        enable_step_cache(pipe, step_cache, steps)
        before = split_calls(pipe)
    with counted_steps("Denoising", steps) as on_step:
        result = generate(pipe, request, on_step=on_step)
    if step_cache is not None and before is not None and (after := split_calls(pipe)) is not None:
        full, calls = after[0] - before[0], after[1] - before[1]
        console.print(f"--cache {step_cache.label}: the full network ran on {full} of {calls} denoiser calls")
    result.images[0].save(out)
    typer.echo(out)


def validate_command(
    engine: Annotated[str, typer.Option(help=f"{store_options.ENGINE_HELP}.")],
    model: store_options.EngineModelOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Denoising steps for the image comparison.")] = 10,
    scheduler: request_options.SchedulerOpt = None,
    images: Annotated[bool, typer.Option("--images/--no-images", help="Also compare generated images.")] = True,
    height: Annotated[int | None, typer.Option(help="Image comparison height (default: profile optimum).")] = None,
    width: Annotated[int | None, typer.Option(help="Image comparison width (default: profile optimum).")] = None,
    min_cosine: Annotated[float | None, typer.Option(help="Override: minimum cosine similarity.")] = None,
    max_abs: Annotated[float | None, typer.Option(help="Override: maximum absolute error.")] = None,
    min_psnr: Annotated[float | None, typer.Option(help="Override: minimum image PSNR in dB.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
    weight_streaming_budget: request_options.WeightBudgetOpt = None,
    memory_budget: graph_options.MemoryBudgetOpt = None,
    cache: request_options.CacheOpt = None,
    report_html: ReportOpt = True,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Compare an engine (or every member of a set) with PyTorch fp32: tensors, latents, images. Exits 3 on a mismatch.

    With --cache, the engine pipeline also generates with the step cache and without, same seed: the full
    evaluations it left, both denoising loops and the cached image's PSNR/SSIM against the uncached one.

    Example: sdtrt validate --model tiny --engine engines/build-ort/2a06c39aaf814d52 --json report.json
    """
    from ..stages.engine_set import engine_members, engine_profile

    budget = request_options.weight_budget(weight_streaming_budget)
    request_options.step_cache(cache)  # a malformed --cache: exit 2 before anything loads
    artifact = None if model else store_options.find_engine(engine, engines)  # a given --model is checked first
    source = store_options.model_for(model, artifact)
    config = ValidationConfig(
        steps=steps, scheduler=scheduler, images=images, height=height, width=width, min_cosine=min_cosine,
        max_abs=max_abs, min_psnr_db=min_psnr, weight_budget=budget,
        memory_budget=graph_options.memory_budget(memory_budget),
    )  # fmt: skip
    rule = SizeRule.for_model(source)
    check_validation(config, rule, None)
    if scheduler:
        check_scheduler(scheduler, source.family(), source.pipeline_class() if source.is_pipeline else "")
    result_files.ensure_parent(json_out, "--json")
    artifact = artifact or store_options.find_engine(engine, engines)
    check_validation(config, rule, engine_profile(engine_members(artifact)))  # the size, against the engines

    from ..tools.validate import validate

    step_cache = request_options.resolve_cache(cache, artifact, source, steps, scheduler)
    report = validate(source, artifact, config)
    print_report(report, results)
    cached = None
    if step_cache is not None:
        from ..tools.step_cache_bench import compare_on_engines

        cached = compare_on_engines(source, artifact, step_cache, config)
        not_judged = " [dim](informational: the tolerances above judge the engines against PyTorch, not this)[/]"
        results.print(cache_comparison_line("engines", cached) + ("" if "error" in cached else not_judged))
    if json_out:
        json_out.write_text(json.dumps(report.to_json() | ({"step_cache": cached} if cached else {}), indent=2))
        if report_html:  # report.json → report.html (a --json named .html keeps its JSON: report.html.html)
            html = json_out.with_suffix(".html")
            write_validation_report(report, artifact, None, html if html != json_out else Path(f"{json_out}.html"))
    report.raise_for_status()
    not_compared = f" ({len(report.skipped)} case(s) not compared: see above)" if report.skipped else ""
    typer.echo(f"parity: PASS{not_compared}")


def check_blocks_command(
    engine: Annotated[str, typer.Option(help="Export artifact (torch.export-based graph): a directory, file or key.")],
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Preset, local diffusers folder, or hub id (default: the model the export was made from).",
        ),
    ] = None,
    block: Annotated[
        list[str] | None,
        typer.Option(
            help="A block to cut and compare, e.g. transformer_blocks.0; repeat for several. Default: the first and "
            "last double-stream, one single-stream (Flux), first and last (SD3), first down and last up (UNet), "
            "first and last layer (CLIP, T5, LLM text encoders), first refiners and first and last layer (Z-Image)."
        ),
    ] = None,
    graph_checks: Annotated[
        bool, typer.Option("--graph-checks/--no-graph-checks", help="Also check IO, inferred shapes, initializers.")
    ] = True,
    min_cosine: Annotated[float | None, typer.Option(help="Override: minimum cosine similarity.")] = None,
    max_abs: Annotated[float | None, typer.Option(help="Override: maximum absolute error.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Check an exported graph against its model by parts, never loading all its weights: IO, inferred shapes and
    initializers, then single blocks cut out and run on ONNX Runtime against the PyTorch block loaded alone.
    Exits 3 on a mismatch.

    Example: sdtrt check-blocks --engine engines/export/6f0b7933d0e6c464 --block transformer_blocks.0
    """
    from ..tools.block_parity import check_blocks, check_checkable

    result_files.ensure_parent(json_out, "--json")
    artifact = store_options.find_engine(engine, engines)
    check_checkable(artifact, block or ())  # before the model resolves (a preset may be built)
    source = store_options.model_for(model, artifact)

    report = check_blocks(source, artifact, block or (), graph_checks, min_cosine, max_abs)
    print_block_report(report, results)
    if json_out:
        json_out.write_text(json.dumps(report.to_json(), indent=2))
    report.raise_for_status()
    typer.echo("parity: PASS")


def print_block_report(report: BlockParityReport, out: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    if params := report.checks.get("parameters"):
        shapes = "; ".join(f"{name}: {shape}" for name, shape in report.checks["output_shapes"].items())
        out.print(
            escape(
                f"graph: {params['parameters']} parameters in {params['initializers']} initializers "
                f"({params['merged_small']} small ones merged), {params['bytes_in_graph']:,} of "
                f"{params['bytes_expected']:,} bytes; {params['constants']} constants; inferred output shapes: {shapes}"
            )
        )
    table = Table(title=f"{report.precision} blocks vs PyTorch fp32 ({report.model})", title_justify="left")
    for column in ("block", "result", "max abs", "mean abs", "cosine", ""):
        table.add_column(column, justify="left" if column in ("block", "result", "") else "right")
    for row in report.blocks:
        for stats in row["outputs"]:
            table.add_row(
                row["block"], escape(result_label(stats["result"])), f"{stats['max_abs']:.3g}",
                f"{stats['mean_abs']:.3g}", f"{stats['cosine']:.6f}",
                "[red]FAIL[/]" if row["failures"] else "[green]ok[/]",
            )  # fmt: skip
    out.print(table)
    tol = report.tolerances
    out.print(
        "block: a module cut out of the graph (run on ONNX Runtime) and the same module loaded alone (PyTorch), on the "
        "same seeded inputs; result: which of the PyTorch block's results the row compares (returned[1][0]: the first "
        "item of its second result); max abs, mean abs: the largest and mean |ONNX Runtime - PyTorch| over its "
        "elements; cosine: their cosine similarity (1: the same)"
    )
    out.print(f"tolerances: cosine ≥ {tol['min_cosine']}, max abs ≤ {tol['max_abs']}")
    for failure in report.failures:
        out.print(f"[red]✗[/] {escape(failure)}")


def result_label(path: str) -> str:
    """Where a compared output sits in what the PyTorch block returns: "0.1" → returned[0][1]; "" → returned."""
    keys = [part if part.isdigit() else repr(part) for part in path.split(".") if part]
    return "returned" + "".join(f"[{key}]" for key in keys)


def print_report(report: ValidationReport, out: Console) -> None:
    from rich.table import Table

    tol = report.tolerances
    table = Table(
        title=f"each {report.precision} engine vs PyTorch fp32: its outputs against its network's, same inputs "
        f"({report.model})",
        title_justify="left",
    )
    what = "member: inputs" if len(report.members) > 1 else "inputs"
    columns = (f"{what} (b batch, H×W px, t timestep, T tokens)", "max abs", "mean abs", "cosine", "")
    for column in columns:
        table.add_column(column, justify="left" if column in (columns[0], "") else "right")
    for row in report.tensors:
        table.add_row(
            row["case"], f"{row['max_abs']:.3g}", f"{row['mean_abs']:.3g}", f"{row['cosine']:.6f}",
            "[red]FAIL[/]" if row["failures"] else "[green]ok[/]",
        )  # fmt: skip
    if report.image:
        lat = report.image["latents"]
        table.add_row(
            "pipeline: final latents (not judged)", f"{lat['max_abs']:.3g}", f"{lat['mean_abs']:.3g}",
            f"{lat['cosine']:.6f}", f"image vs PyTorch's: PSNR {report.image['psnr_db']:.1f} dB",
        )  # fmt: skip
    out.print(table)
    psnr = f", PSNR ≥ {tol.min_psnr_db} dB" if report.image else ""
    held = (
        " (the image's and the least precise member's; each other member's tensors are held to its own precision's)"
        if len(report.members) > 1
        else ""
    )
    out.print(f"tolerances{held}: cosine ≥ {tol.min_cosine}, max abs ≤ {tol.max_abs}{psnr}")
    for skipped in report.skipped:
        out.print(f"[yellow]![/] {skipped}")
    for failure in report.failures:
        out.print(f"[red]✗[/] {failure}")
