"""The compile command: every stage for a target in order, then validate (and the accuracy guard of an 8-bit
compile). Prints the final artifact's directory last on stdout.

Library modules that import torch, diffusers or onnx are imported inside the command.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from ..core.artifact import Artifact, located
from ..core.config import STEP_CACHES, Precision, ValidationConfig
from ..core.errors import ConfigError, RequestError
from ..core.progress import console
from ..spec import denoiser_component
from . import build_options, graph_options, store_options
from .quantize_options import (
    CalibrationPromptsOpt,
    CompileAlgorithmOpt,
    CompileLevelOpt,
    CompileStepsOpt,
    check_quantizable,
    quant_level,
    quantize_config,
)
from .report import ReportOpt, write_validation_report
from .stages import parse_components, print_simplify_summary

if TYPE_CHECKING:
    from ..tools.guard import GuardReport

CompilePrecisionOpt = Annotated[
    str,
    typer.Option(
        help="Graph precision: fp16, bf16 (for --target tensorrt) or fp32; int8 or fp8 quantize the denoiser with "
        "NVIDIA ModelOpt (see `sdtrt quantize`), the other networks as for fp16 (fp16; a VAE that must upcast fp32)."
    ),
]


def register(app: typer.Typer) -> None:
    app.command()(compile)


@build_options.with_trt_options
def compile(
    model: store_options.ModelOpt = "tiny",
    target: build_options.TargetOpt = "auto",
    precision: CompilePrecisionOpt = "fp16",
    level: CompileLevelOpt = None,
    calibration_prompts: CalibrationPromptsOpt = None,
    calibration_steps: CompileStepsOpt = None,
    algorithm: CompileAlgorithmOpt = None,
    min_psnr: Annotated[
        float | None,
        typer.Option(
            help="int8/fp8: the accuracy guard's target, the image PSNR (dB) against the fp32 pipeline. Below it the "
            "quantized layers whose own outputs err most return to high precision and the denoiser is quantized again, "
            "round by round; exit 3 when the target cannot be met."
        ),
    ] = None,
    guard_rounds: Annotated[int, typer.Option(min=1, help="The accuracy guard's quantizations at most.")] = 3,
    exporter: graph_options.ExporterOpt = "auto",
    opset: graph_options.OpsetOpt = 18,
    io_naming: graph_options.IONamingOpt = "named",
    weights: graph_options.WeightsOpt = "auto",
    method: graph_options.MethodOpt = "auto",
    memory_budget: graph_options.MemoryBudgetOpt = None,
    batch: build_options.BatchOpt = None,
    height: build_options.HeightOpt = None,
    width: build_options.WidthOpt = None,
    tokens: build_options.TokensOpt = None,
    trt: build_options.TrtOptions = build_options.TrtOptions(),  # the TensorRT options, declared by with_trt_options
    validate: Annotated[
        bool, typer.Option("--validate/--no-validate", help="Check the result against PyTorch (exit 3 on mismatch).")
    ] = True,
    revalidate: Annotated[
        bool, typer.Option("--revalidate", help="Validate again even when a report for these engines is stored.")
    ] = False,
    components: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated, of {graph_options.COMPONENTS_HELP} (default: every one the model has); "
            "several give an engine set."
        ),
    ] = None,
    caches: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated step caches to build the denoiser's split members for ({', '.join(STEP_CACHES)}; "
            "deepcache for a UNet, the others for a transformer, where one split serves all three; FLUX.2: "
            "taylorseer, first-block refused; Z-Image: none; docs/guide/step-caching.md has the table); then `--cache` "
            "on generate, bench, validate and deploy runs them.",
        ),
    ] = None,
    freeu: Annotated[
        bool,
        typer.Option(
            "--freeu",
            help="Add a FreeU build of the UNet to the set (the UNet again, FreeU's s1, s2, b1, b2 an input), so that "
            "pipe.enable_freeu(...) runs on the engines; the plain UNet engine is unchanged and runs with FreeU off.",
        ),
    ] = False,
    ip_adapter: Annotated[
        str | None,
        typer.Option(
            "--ip-adapter",
            metavar="PATH",
            help="Compile an IP-Adapter into the denoiser (SD 1.x, SDXL, Flux.1): its weight file in h94/IP-Adapter's "
            "(XLabs' for Flux) layout (or a folder holding one), its image_encoder/ beside it; the image embeds and "
            "per-layer scales become engine inputs, so pipe(ip_adapter_image=...) and pipe.set_ip_adapter_scale(...) "
            "run on the engines.",
        ),
    ] = None,
    ip_adapter_image_encoder: Annotated[
        str | None,
        typer.Option(
            "--ip-adapter-image-encoder",
            metavar="DIR",
            help="The --ip-adapter's image encoder folder where it is not the image_encoder/ beside the file "
            "(diffusers' image_encoder_folder; h94's sdxl_models/ip-adapter_sdxl_vit-h needs models/image_encoder).",
        ),
    ] = None,
    report: ReportOpt = True,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Run every stage for a target in order, then validate; unchanged stages are cache hits.

    onnxruntime: export → simplify → build, per component.  tensorrt: export → simplify → build → wrap.
    tensorrt-rtx: export → simplify → build (TensorRT-RTX plans, built without a GPU; their graphs are validated).
    Several components end in an engine set, whose directory is printed last.

    Example: sdtrt compile --model tiny --target onnxruntime --components unet,text_encoder,vae_decoder
    Step caches: sdtrt compile --model tiny-flux --target onnxruntime --caches first-block
    FreeU: sdtrt compile --model tiny --target onnxruntime --freeu
    IP-Adapter: sdtrt ip-adapter random --model tiny --out ip-adapter, then
    sdtrt compile --model tiny --target onnxruntime --ip-adapter ip-adapter
    """
    from ..sources.ip_adapters import resolve_ip_adapter
    from ..sources.models import resolve_model
    from ..stages import export as export_stage
    from ..tools.compile import cache_members, check_ip_adapter, compile_model, freeu_member
    from .run import print_report

    graph_options.check_export_options(exporter, weights)
    trt.check(target)
    simplify_config = graph_options.simplify_config(method, True, memory_budget)
    if revalidate and not validate:
        raise RequestError("--revalidate asks for a validation that --no-validate turns off: pass one of them")
    if level is not None:
        quant_level(level)  # a malformed --level is refused whatever the precision
    quantized = None
    if precision in ("int8", "fp8"):
        quantized = quantize_config(precision, level, algorithm, calibration_prompts, calibration_steps)
    elif precision not in ("fp16", "bf16", "fp32"):
        raise RequestError(f"precision '{precision}' is not one of fp16, bf16, fp32, int8, fp8")
    elif given := [f"--{name}" for name, value in (("level", level), ("algorithm", algorithm),
                   ("calibration-prompts", calibration_prompts), ("calibration-steps", calibration_steps))
                   if value is not None]:  # fmt: skip
        raise RequestError(
            f"{given[0]} configures the quantization of --precision int8 or fp8, and this compile is {precision}: "
            f"pass --precision int8 or fp8 with it, or leave {given[0]} out"
        )
    if min_psnr is not None and not (quantized and validate):
        raise RequestError(
            "--min-psnr is the accuracy guard of an 8-bit compile's validation: use it with --precision int8 or fp8, "
            "and without --no-validate"
        )
    graph_precision = cast(Precision, "fp16" if quantized else precision)  # the members the denoiser runs beside
    build_options.check_target_precision(target, graph_precision)
    store = store_options.open_store(engines, cached_ok=True)  # a read-only store serves a complete cache hit
    source = resolve_model(model)
    if quantized:
        check_quantizable(quantized, source)
    chosen_components = parse_components(components, source)
    chosen_caches = tuple(c.strip() for c in (caches or "").split(",") if c.strip())
    try:  # a cache or FreeU the model cannot take is a usage error, before any export
        cache_members(source, chosen_caches)
        freeu_member(source, freeu)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None
    denoiser = denoiser_component(source)
    if chosen_caches and chosen_components and denoiser not in chosen_components:
        console.print(f"[dim]--caches: the {denoiser} joins the set (its split members run beside it)[/]")
    elif freeu and chosen_components and denoiser not in chosen_components:
        console.print(f"[dim]--freeu: the {denoiser} joins the set (FreeU's build runs beside it)[/]")
    # Each member's export config is this one with its component; the profile is the denoiser's.
    export_config = graph_options.export_config(
        graph_precision, exporter, opset, io_naming, denoiser_component(source), weights
    )
    if ip_adapter_image_encoder and not ip_adapter:
        raise RequestError("--ip-adapter-image-encoder is the image encoder of an --ip-adapter: pass one")
    if ip_adapter:  # the files, resolved: what the denoiser's export config records
        files = resolve_ip_adapter(ip_adapter, ip_adapter_image_encoder)
        encoder = str(files.image_encoder) if ip_adapter_image_encoder else ""
        export_config = replace(export_config, ip_adapter=str(files.weights), ip_adapter_image_encoder=encoder)
        try:
            check_ip_adapter(source, export_config, chosen_caches, freeu, quantized)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        if chosen_components and denoiser not in chosen_components:
            console.print(f"[dim]--ip-adapter: the {denoiser} joins the set (the adapter goes into it)[/]")
    profile = build_options.shape_profile(export_stage.spec_for(source, export_config), batch, height, width, tokens)
    options: dict[str, Any] = dict(
        target=target,
        export_config=export_config,
        simplify_config=simplify_config,
        profile=profile,
        trt_config=trt.config(profile, target),
        components=chosen_components,
        revalidate=revalidate,
        caches=chosen_caches,
        freeu=freeu,
    )
    validation = ValidationConfig(memory_budget=simplify_config.memory_budget)
    guarded = None
    if min_psnr is not None and quantized is not None:
        from ..tools.guard import GuardConfig, guard

        guarded = guard(source, store, quantized, GuardConfig(min_psnr, guard_rounds), validation, **options)
        result = guarded.result
    else:
        result = compile_model(
            source, store, validation=validation if validate else None, quantize_config=quantized, **options
        )
    for artifact in result.artifacts:
        if artifact.stage == "simplify" and artifact.path not in store.reused:  # a reused one said "cached" already
            print_simplify_summary(artifact)
    console.print(f"target: {result.target_reason}")
    if result.validation_note:
        from rich.markup import escape

        console.print(f"validate: {escape(result.validation_note)}")
    if result.validation is not None:
        if result.validation_cached:
            console.print("[green]✓[/] validate: cached report for these engines [dim](--revalidate runs it again)[/]")
        print_report(result.validation, console)
        if report:
            # The engine as this store holds it: a cached report records where it was validated, which may have moved.
            validated = Artifact.open(located(Path(result.validation.engine), store.root))
            write_validation_report(result.validation, validated, store)
    if guarded is not None:
        print_guard_rounds(guarded)
        guarded.raise_for_status()
    if result.validation is not None:
        result.validation.raise_for_status()
    typer.echo(result.final.path)


def print_guard_rounds(report: GuardReport) -> None:
    """The accuracy guard's rounds: the PSNR each reached and the layers it returned to high precision."""
    for number, row in enumerate(report.rounds, 1):
        returned = f"; returning to high precision: {', '.join(row.returned)}" if row.returned else ""
        console.print(
            f"guard: round {number}: image PSNR {row.psnr_db:.1f} dB (target {report.min_psnr_db:g}){returned}"
        )
    kept = ", ".join(report.kept) or "none"
    console.print(f"guard: {'met' if report else 'not met'}; layers kept in high precision by the guard: {kept}")
