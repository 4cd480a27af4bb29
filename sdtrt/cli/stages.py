"""Stage commands: export, simplify, build, wrap, compile. Each prints its artifact's directory last on stdout.

Library modules that import torch, diffusers or onnx are imported inside the commands.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer

from ..core.config import (
    CALIBRATION_PROMPTS,
    COMPONENTS,
    QUANT_LEVELS,
    Component,
    OrtOptimization,
    Precision,
    QuantAlgorithm,
    QuantizeConfig,
    QuantPrecision,
    ValidationConfig,
    WrapConfig,
    parse_level,
)
from ..core.errors import ArtifactError, ConfigError, RequestError
from ..core.progress import console
from ..spec import denoiser_component, model_components
from . import options as o

if TYPE_CHECKING:
    from ..core.artifact import Artifact
    from ..sources.models import ModelSource
    from ..tools.guard import GuardReport

InputArg = Annotated[
    str, typer.Argument(help="The previous stage's artifact: a directory or .onnx file, or a key from `cache ls`.")
]
# Quantization (`quantize`, and `compile --precision int8|fp8`).
QuantPrecisionOpt = Annotated[QuantPrecision, typer.Option("--precision", help="int8, or fp8 (E4M3).")]
LEVEL_HELP = "NVIDIA's quantization level: " + "; ".join(f"{k:g}: {v}" for k, v in QUANT_LEVELS.items()) + "."
# A str parsed by config.parse_level: a bad level is one line naming the levels, not Typer's error box.
LEVEL_METAVAR = f"<{'|'.join(f'{k:g}' for k in QUANT_LEVELS)}>"
LevelOpt = Annotated[str, typer.Option(metavar=LEVEL_METAVAR, help=LEVEL_HELP)]
CalibrationPromptsOpt = Annotated[
    str | None,
    typer.Option(
        help=f"A text file of prompts (one a line), or N: the first N of sdtrt's {len(CALIBRATION_PROMPTS)} built-in "
        f"prompts (default {len(QuantizeConfig().calibration_prompts)})."
    ),
]
STEPS_HELP = "Denoising steps per calibration prompt; every step's denoiser inputs calibrate."
CalibrationStepsOpt = Annotated[int, typer.Option(help=STEPS_HELP)]
ALGORITHM_HELP = "INT8 calibration: max (ModelOpt's preset) or smoothquant."
AlgorithmOpt = Annotated[QuantAlgorithm, typer.Option(help=ALGORITHM_HELP)]
# compile's: unset unless given, so that one given without --precision int8|fp8 is refused, not ignored.
_DEFAULTS = QuantizeConfig()
CompileLevelOpt = Annotated[
    str | None,
    typer.Option("--level", metavar=LEVEL_METAVAR, help=f"{LEVEL_HELP} int8/fp8 only (default {_DEFAULTS.level:g})."),
]
CompileStepsOpt = Annotated[
    int | None,
    typer.Option("--calibration-steps", help=f"{STEPS_HELP} int8/fp8 only (default {_DEFAULTS.calibration_steps})."),
]
CompileAlgorithmOpt = Annotated[
    QuantAlgorithm | None,
    typer.Option("--algorithm", help=f"{ALGORITHM_HELP} int8 only (default {_DEFAULTS.algorithm})."),
]
CompilePrecisionOpt = Annotated[
    str,
    typer.Option(
        help="Graph precision: fp16, bf16 (for --target tensorrt) or fp32; int8 or fp8 quantize the denoiser with "
        "NVIDIA ModelOpt (see `sdtrt quantize`), the other networks as for fp16 (fp16; a VAE that must upcast fp32)."
    ),
]


def register(app: typer.Typer) -> None:
    app.command()(export)
    app.command()(quantize)
    app.command()(simplify)
    app.command()(build)
    app.command()(wrap)
    app.command()(compile)


def export(
    model: o.ModelOpt = "tiny",
    component: o.ComponentOpt = None,
    precision: o.PrecisionOpt = "fp16",
    exporter: o.ExporterOpt = "auto",
    opset: o.OpsetOpt = 18,
    io_naming: o.IONamingOpt = "named",
    weights: o.WeightsOpt = "auto",
    engines: o.EnginesOpt = None,
) -> None:
    """Export one of the model's networks (its denoiser by default) to ONNX, with dynamic batch, height and width.

    Example: sdtrt export --model tiny --component vae_decoder --precision fp16
    """
    from ..sources.models import resolve_model
    from ..stages import export as export_stage

    o.check_export_options(exporter, weights)
    store = o.open_store(engines)
    source = resolve_model(model)
    if component is not None:
        parse_components(component, source)  # a network the model lacks: compile's one line, exit 2
    config = o.export_config(precision, exporter, opset, io_naming, component or denoiser_component(source), weights)
    artifact = export_stage.run(config, source, store)
    typer.echo(artifact.path)


def quantize(
    model: o.ModelOpt = "tiny",
    precision: QuantPrecisionOpt = "int8",
    level: LevelOpt = "2.5",
    calibration_prompts: CalibrationPromptsOpt = None,
    calibration_steps: CalibrationStepsOpt = QuantizeConfig().calibration_steps,
    algorithm: AlgorithmOpt = "max",
    engines: o.EnginesOpt = None,
) -> None:
    """Quantize the denoiser (UNet or transformer) to INT8/FP8 Q/DQ graphs with ModelOpt, calibrated on its own steps.

    Writes the graph ONNX Runtime runs (the artifact's primary, for simplify/build/validate) and the one TensorRT
    builds (the manifest's `graphs`). Example: sdtrt quantize --model tiny --precision fp8 --level 3
    """
    from ..sources.models import resolve_model
    from ..stages import quantize as quantize_stage

    config = quantize_config(precision, level, algorithm, calibration_prompts, calibration_steps)
    store = o.open_store(engines)
    source = resolve_model(model)
    check_quantizable(config, source)
    artifact = quantize_stage.run(config, source, store)
    details = artifact.manifest["details"]
    console.print(
        f"quantized {len(details['quantized_layers'])} layers; {kept_summary(details['kept_high_precision'])}; "
        f"Q/DQ: {', '.join(f'{k} {v}' for k, v in details['qdq']['onnxruntime'].items())}"
    )
    typer.echo(artifact.path)


def kept_summary(kept: dict[str, str]) -> str:
    """The layers left in high precision, counted by why: "136 in high precision (56 kept by NVIDIA, 80 left out by
    level 2.5)"; the manifest lists each one with its reason."""
    whys = Counter(
        "left out by " + why.split(":")[0] if why.startswith("level ") else why.split(" (")[0] for why in kept.values()
    )
    if not kept:
        return "none in high precision"
    return f"{len(kept)} in high precision ({', '.join(f'{n} {why}' for why, n in whys.items())})"


def quantize_config(
    precision: str, level: str | None, algorithm: str | None, prompts: str | None, steps: int | None
) -> QuantizeConfig:
    """The options as a QuantizeConfig (QuantizeConfig's defaults for those None), or RequestError (exit 2) before
    anything loads."""
    try:
        config = QuantizeConfig(
            precision=cast(QuantPrecision, precision),
            level=_DEFAULTS.level if level is None else quant_level(level),
            algorithm=cast(QuantAlgorithm, algorithm or _DEFAULTS.algorithm),
            calibration_steps=_DEFAULTS.calibration_steps if steps is None else steps,
        )
        chosen = calibration_prompts(prompts)
        return dataclasses.replace(config, calibration_prompts=chosen) if chosen else config
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def quant_level(text: str) -> float:
    """--level, or RequestError (exit 2) naming NVIDIA's levels."""
    try:
        return parse_level(text)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def calibration_prompts(text: str | None) -> tuple[str, ...] | None:
    """--calibration-prompts: N (of the built-in prompts) or a file of prompts, one a line; None: the default."""
    from pathlib import Path

    if text is None:
        return None
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= len(CALIBRATION_PROMPTS):
            raise RequestError(
                f"--calibration-prompts {count}: sdtrt has {len(CALIBRATION_PROMPTS)} built-in prompts; "
                "give 1.." + f"{len(CALIBRATION_PROMPTS)}, or a file with more (one prompt a line)"
            )
        return CALIBRATION_PROMPTS[:count]
    path = Path(text)
    if not path.is_file():
        raise RequestError(f"--calibration-prompts '{text}' is neither a number nor a readable file of prompts")
    prompts = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not prompts:
        raise RequestError(f"--calibration-prompts {path} holds no prompt (one prompt a line)")
    return prompts


def check_quantizable(config: QuantizeConfig, source: ModelSource) -> None:
    """The model's configs against the quantization config (level 4's head sizes, …): exit 2 before loading."""
    from ..stages.quantize import check_model

    try:
        check_model(config, source)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def simplify(
    source: InputArg,
    method: o.MethodOpt = "auto",
    check: o.CheckOpt = True,
    memory_budget: o.MemoryBudgetOpt = None,
    engines: o.EnginesOpt = None,
) -> None:
    """Simplify an exported graph and print op counts before and after.

    Example: sdtrt simplify engines/export/1d00aad79ae0e190 --memory-budget 8GiB
    """
    from ..graph.onnx_graph import ONNX_STAGES
    from ..stages import simplify as simplify_stage

    config = o.simplify_config(method, check, memory_budget)
    store = o.open_store(engines)
    graph = one_graph(store.find(source), "simplify", ONNX_STAGES, "export")
    artifact = simplify_stage.run(config, graph, store)
    print_simplify_summary(artifact)
    typer.echo(artifact.path)


@o.with_trt_options
def build(
    source: InputArg,
    target: o.TargetOpt = "auto",
    batch: o.BatchOpt = None,
    height: o.HeightOpt = None,
    width: o.WidthOpt = None,
    tokens: o.TokensOpt = None,
    optimization: Annotated[OrtOptimization, typer.Option(help="ONNX Runtime graph optimization level.")] = "extended",
    trt: o.TrtOptions = o.TrtOptions(),  # the TensorRT options, declared by with_trt_options
    engines: o.EnginesOpt = None,
) -> None:
    """Build an engine from a simplified (or exported) graph for the shapes given.

    Example: sdtrt build engines/simplify/070be7b4789a3682 --target tensorrt --height 256:512:768
    """
    from ..graph.onnx_graph import ONNX_STAGES, artifact_spec
    from ..tools.compile import build as build_engine

    trt.check(target)
    store = o.open_store(engines)
    artifact = one_graph(store.find(source), "build", ONNX_STAGES, "simplify")
    spec = artifact_spec(artifact)
    o.check_target_precision(target, spec.precision)
    profile = o.shape_profile(spec, batch, height, width, tokens)
    built, reason = build_engine(artifact, store, target, profile, optimization, trt_config=trt.config(profile, target))
    console.print(f"target: {reason}")
    typer.echo(built.path)


def wrap(source: InputArg, engines: o.EnginesOpt = None) -> None:
    """Embed a TensorRT engine in a TorchScript module (<component>.ts) that torch.jit.load can load.

    Example: sdtrt wrap engines/build-trt/5c1f0e2a9b7d4e61
    """
    from ..stages import wrap as wrap_stage

    store = o.open_store(engines)
    engine = one_graph(store.find(source), "wrap", ("build-trt",), "build-trt")
    typer.echo(wrap_stage.run(WrapConfig(), engine, store).path)


@o.with_trt_options
def compile(
    model: o.ModelOpt = "tiny",
    target: o.TargetOpt = "auto",
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
    exporter: o.ExporterOpt = "auto",
    opset: o.OpsetOpt = 18,
    io_naming: o.IONamingOpt = "named",
    weights: o.WeightsOpt = "auto",
    method: o.MethodOpt = "auto",
    memory_budget: o.MemoryBudgetOpt = None,
    batch: o.BatchOpt = None,
    height: o.HeightOpt = None,
    width: o.WidthOpt = None,
    tokens: o.TokensOpt = None,
    trt: o.TrtOptions = o.TrtOptions(),  # the TensorRT options, declared by with_trt_options
    validate: Annotated[
        bool, typer.Option("--validate/--no-validate", help="Check the result against PyTorch (exit 3 on mismatch).")
    ] = True,
    revalidate: Annotated[
        bool, typer.Option("--revalidate", help="Validate again even when a report for these engines is stored.")
    ] = False,
    components: Annotated[
        str | None,
        typer.Option(
            help=f"Comma-separated, of {', '.join(COMPONENTS)} (default: every one the model has); "
            "several give an engine set."
        ),
    ] = None,
    engines: o.EnginesOpt = None,
) -> None:
    """Run every stage for a target in order, then validate; unchanged stages are cache hits.

    onnxruntime: export → simplify → build, per component.  tensorrt: export → simplify → build → wrap.
    tensorrt-rtx: export → simplify → build (TensorRT-RTX plans, built without a GPU; their graphs are validated).
    Several components end in an engine set, whose directory is printed last.

    Example: sdtrt compile --model tiny --target onnxruntime --components unet,text_encoder,vae_decoder
    """
    from ..sources.models import resolve_model
    from ..stages import export as export_stage
    from ..tools.compile import compile_model
    from .run import print_report

    o.check_export_options(exporter, weights)
    trt.check(target)
    simplify_config = o.simplify_config(method, True, memory_budget)
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
    o.check_target_precision(target, graph_precision)
    store = o.open_store(engines, cached_ok=True)  # a read-only store serves a complete cache hit
    source = resolve_model(model)
    if quantized:
        check_quantizable(quantized, source)
    chosen_components = parse_components(components, source)
    # Each member's export config is this one with its component; the profile is the denoiser's.
    export_config = o.export_config(graph_precision, exporter, opset, io_naming, denoiser_component(source), weights)
    profile = o.shape_profile(export_stage.spec_for(source, export_config), batch, height, width, tokens)
    options: dict[str, Any] = dict(
        target=target,
        export_config=export_config,
        simplify_config=simplify_config,
        profile=profile,
        trt_config=trt.config(profile, target),
        components=chosen_components,
        revalidate=revalidate,
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


def one_graph(artifact: Artifact, command: str, takes: tuple[str, ...], wanted: str) -> Artifact:
    """``artifact`` when ``command`` takes its stage; else ArtifactError naming it, and for an engine set the
    members' ``wanted``-stage artifacts (from each member's lineage) to pass instead."""
    if artifact.stage in takes:
        return artifact
    if artifact.stage != "set":
        raise ArtifactError(
            f"{command} takes {' or '.join(takes)} artifacts, and {artifact.path} is a '{artifact.stage}' artifact; "
            f"pass the {wanted} artifact a stage printed"
        )
    from ..stages.engine_set import members

    found = {c: next((a.path for a in m.lineage() if a.stage == wanted), None) for c, m in members(artifact).items()}
    listed = "; ".join(f"{c}: {path}" for c, path in found.items() if path is not None)
    raise ArtifactError(
        f"{command} takes one graph, and {artifact.path} is an engine set; pass one of its members' {wanted} "
        f"artifacts instead ({listed or 'the set holds none'})"
    )


def print_simplify_summary(artifact: Artifact) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..stages.simplify import op_table_rows

    details = artifact.manifest["details"]
    # Why the method that ran did: the fallback's reason (onnxsim failed, a Q/DQ graph) where there was one.
    reason = details.get("fallback_reason") or details.get("method_reason")
    why = f" ({reason})" if reason else ""
    table = Table(title=escape(f"Simplified with {details['method']}{why}"), title_justify="left")
    table.add_column("op")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for op, before, after in op_table_rows(details["op_counts_before"], details["op_counts_after"]):
        style = "bold" if op == "Total" else ("green" if after < before else "")
        table.add_row(op, str(before), str(after), style=style)
    console.print(table)
    if details.get("weights_carried"):
        console.print(f"weights: {escape(details['weights_carried'])}")
    if check := details.get("check"):
        console.print(f"ONNX Runtime check: cosine {check['cosine']:.6f}, max abs {check['max_abs']:.3g}")


def parse_components(text: str | None, source: ModelSource) -> tuple[Component, ...] | None:
    """--components, checked against the model (None: compile's default)."""
    if text is None:
        return None
    have = model_components(source)
    wanted = tuple(c.strip() for c in text.split(",") if c.strip())
    for name in wanted:
        if name not in COMPONENTS:
            raise RequestError(f"unknown component '{name}'; choose from {', '.join(COMPONENTS)}")
        if name not in have:
            raise RequestError(f"model '{source.name}' has no {name} (it has {', '.join(have)})")
    return cast(tuple[Component, ...], tuple(dict.fromkeys(wanted)))
