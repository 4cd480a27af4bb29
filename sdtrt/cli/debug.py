"""``sdtrt debug``: which layer of an engine first leaves fp32 (Polygraphy, every tensor an output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..core.errors import RequestError
from ..core.progress import results, step
from . import result_files, store_options


def register(app: typer.Typer) -> None:
    app.command(name="debug")(debug_command)


def debug_command(
    engine: Annotated[str, typer.Argument(help=f"{store_options.ENGINE_HELP} (a set: each member), or a bare .onnx.")],
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="For a bare .onnx that is no SD UNet: the model it is from.")
    ] = None,
    max_error: Annotated[
        float, typer.Option(help="Normalised error (max |engine - fp32| / max |fp32|) past which a tensor diverges.")
    ] = 0.05,
    height: Annotated[
        int | None,
        typer.Option(help="Input height in pixels, on the model's grid and in the profile (default: its smallest)."),
    ] = None,
    width: Annotated[
        int | None,
        typer.Option(help="Input width in pixels, on the model's grid and in the profile (default: its smallest)."),
    ] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Find the first layer whose output diverges from fp32 or turns NaN/inf. Exits 3 when one does.

    Runs the engine's graph and an fp32 replica of it with every intermediate tensor marked as an output
    (ONNX graphs on ONNX Runtime; TensorRT engines rebuilt from their graph on the GPU). An engine set:
    each member in turn, reported by component.

    Example: sdtrt debug engines/build-ort/2a06c39aaf814d52 --json debug.json
    """
    from ..core.errors import ParityError
    from ..sources.models import resolve_model
    from ..tools.debug import DebugConfig, debug, debug_set

    if not max_error > 0:
        raise RequestError(f"--max-error {max_error}: a normalised error limit must be above 0 (e.g. 0.05)")
    artifact = store_options.find_engine(engine, engines, option=None)
    source = resolve_model(model) if model else None
    result_files.ensure_parent(json_out, "--json")
    config = DebugConfig(max_error=max_error, height=height, width=width)
    is_set = artifact.stage == "set"
    with step("Running the engine and its fp32 replica with every tensor an output"):
        reports = debug_set(artifact, config) if is_set else {"engine": debug(artifact, config, source)}
    for component, report in reports.items():
        label = f"{component}: " if is_set else ""
        results.print(
            f"{label}{report.compared} tensors compared on {report.backend}; largest error {report.largest_error:.3g}"
        )
        for row in report.worst:
            results.print(escape(f"  {row['error']:.3g}  {row['op']:12s} {row['tensor']}"))
    if json_out:
        content = {c: r.to_json() for c, r in reports.items()} if is_set else reports["engine"].to_json()
        json_out.write_text(json.dumps(content, indent=2))
    problems = [f"{c}: {problem}" if is_set else problem for c, r in reports.items() if (problem := r.problem())]
    if problems:
        raise ParityError(problems[0])
    typer.echo(f"no layer diverges past {max_error}")
