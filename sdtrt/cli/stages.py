"""Stage commands: export, quantize, simplify, build, wrap (compile, which runs them in order, is in compile.py).
Each prints its artifact's directory last on stdout.

Library modules that import torch, diffusers or onnx are imported inside the commands.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Annotated, cast

import typer

from ..core.config import Component, OrtOptimization, QuantizeConfig, WrapConfig
from ..core.errors import ArtifactError, RequestError
from ..core.progress import console
from ..spec import denoiser_component, model_components
from . import build_options, graph_options, store_options
from .quantize_options import (
    AlgorithmOpt,
    CalibrationPromptsOpt,
    CalibrationStepsOpt,
    LevelOpt,
    QuantPrecisionOpt,
    check_quantizable,
    quantize_config,
)

if TYPE_CHECKING:
    from ..core.artifact import Artifact
    from ..sources.models import ModelSource

InputArg = Annotated[
    str, typer.Argument(help="The previous stage's artifact: a directory or .onnx file, or a key from `cache ls`.")
]


def register(app: typer.Typer) -> None:
    app.command()(export)
    app.command()(quantize)
    app.command()(simplify)
    app.command()(build)
    app.command()(wrap)


def export(
    model: store_options.ModelOpt = "tiny",
    component: graph_options.ComponentOpt = None,
    precision: graph_options.PrecisionOpt = "fp16",
    exporter: graph_options.ExporterOpt = "auto",
    opset: graph_options.OpsetOpt = 18,
    io_naming: graph_options.IONamingOpt = "named",
    weights: graph_options.WeightsOpt = "auto",
    engines: store_options.EnginesOpt = None,
) -> None:
    """Export one of the model's networks (its denoiser by default) to ONNX, with dynamic batch, height and width.

    Example: sdtrt export --model tiny --component vae_decoder --precision fp16
    """
    from ..sources.models import resolve_model
    from ..stages import export as export_stage

    graph_options.check_export_options(exporter, weights)
    store = store_options.open_store(engines)
    source = resolve_model(model)
    if component is not None:
        parse_components(component, source)  # a network the model lacks: compile's one line, exit 2
    config = graph_options.export_config(
        precision, exporter, opset, io_naming, component or denoiser_component(source), weights
    )
    artifact = export_stage.run(config, source, store)
    typer.echo(artifact.path)


def quantize(
    model: store_options.ModelOpt = "tiny",
    precision: QuantPrecisionOpt = "int8",
    level: LevelOpt = "2.5",
    calibration_prompts: CalibrationPromptsOpt = None,
    calibration_steps: CalibrationStepsOpt = QuantizeConfig().calibration_steps,
    algorithm: AlgorithmOpt = "max",
    engines: store_options.EnginesOpt = None,
) -> None:
    """Quantize the denoiser (UNet or transformer) to INT8/FP8 Q/DQ graphs with ModelOpt, calibrated on its own steps.

    Writes the graph ONNX Runtime runs (the artifact's primary, for simplify/build/validate) and the one TensorRT
    builds (the manifest's `graphs`). Example: sdtrt quantize --model tiny --precision fp8 --level 3
    """
    from ..sources.models import resolve_model
    from ..stages import quantize as quantize_stage

    config = quantize_config(precision, level, algorithm, calibration_prompts, calibration_steps)
    store = store_options.open_store(engines)
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


def simplify(
    source: InputArg,
    method: graph_options.MethodOpt = "auto",
    check: graph_options.CheckOpt = True,
    memory_budget: graph_options.MemoryBudgetOpt = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Simplify an exported graph and print op counts before and after.

    Example: sdtrt simplify engines/export/1d00aad79ae0e190 --memory-budget 8GiB
    """
    from ..graph.onnx_graph import ONNX_STAGES
    from ..stages import simplify as simplify_stage

    config = graph_options.simplify_config(method, check, memory_budget)
    store = store_options.open_store(engines)
    graph = one_graph(store.find(source), "simplify", ONNX_STAGES, "export")
    artifact = simplify_stage.run(config, graph, store)
    print_simplify_summary(artifact)
    typer.echo(artifact.path)


@build_options.with_trt_options
def build(
    source: InputArg,
    target: build_options.TargetOpt = "auto",
    batch: build_options.BatchOpt = None,
    height: build_options.HeightOpt = None,
    width: build_options.WidthOpt = None,
    tokens: build_options.TokensOpt = None,
    optimization: Annotated[OrtOptimization, typer.Option(help="ONNX Runtime graph optimization level.")] = "extended",
    trt: build_options.TrtOptions = build_options.TrtOptions(),  # the TensorRT options, declared by with_trt_options
    engines: store_options.EnginesOpt = None,
) -> None:
    """Build an engine from a simplified (or exported) graph for the shapes given.

    Example: sdtrt build engines/simplify/070be7b4789a3682 --target tensorrt --height 256:512:768
    """
    from ..graph.onnx_graph import ONNX_STAGES, artifact_spec
    from ..tools.compile import build as build_engine

    trt.check(target)
    store = store_options.open_store(engines)
    artifact = one_graph(store.find(source), "build", ONNX_STAGES, "simplify")
    spec = artifact_spec(artifact)
    build_options.check_target_precision(target, spec.precision)
    profile = build_options.shape_profile(spec, batch, height, width, tokens)
    built, reason = build_engine(artifact, store, target, profile, optimization, trt_config=trt.config(profile, target))
    console.print(f"target: {reason}")
    typer.echo(built.path)


def wrap(source: InputArg, engines: store_options.EnginesOpt = None) -> None:
    """Embed a TensorRT engine in a TorchScript module (<component>.ts) that torch.jit.load can load.

    Example: sdtrt wrap engines/build-trt/5c1f0e2a9b7d4e61
    """
    from ..stages import wrap as wrap_stage

    store = store_options.open_store(engines)
    engine = one_graph(store.find(source), "wrap", ("build-trt",), "build-trt")
    typer.echo(wrap_stage.run(WrapConfig(), engine, store).path)


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
        if name not in graph_options.NAMED_COMPONENTS:
            raise RequestError(f"unknown component '{name}'; choose from {graph_options.COMPONENTS_HELP}")
        if name not in have:
            raise RequestError(f"model '{source.name}' has no {name} (it has {', '.join(have)})")
    return cast(tuple[Component, ...], tuple(dict.fromkeys(wanted)))
