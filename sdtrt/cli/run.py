"""Commands that use an engine: generate images, validate against PyTorch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..models import resolve_model
from ..pipeline import SCHEDULERS, GenerateRequest, generate, load_pipeline
from ..progress import console, step
from ..store import Artifact
from ..validate import ValidationConfig, ValidationReport, validate
from . import options as o

EngineOpt = Annotated[
    Path | None,
    typer.Option(help="Engine artifact (directory or file) from `sdtrt compile`/`build`; omit for plain PyTorch."),
]
SchedulerOpt = Annotated[str | None, typer.Option(help=f"Scheduler: {', '.join(SCHEDULERS)} (default: the model's).")]


def register(app: typer.Typer) -> None:
    app.command(name="generate")(generate_command)
    app.command(name="validate")(validate_command)


def generate_command(
    prompt: Annotated[str, typer.Option(help="What to draw.")] = GenerateRequest.prompt,
    model: o.ModelOpt = "tiny",
    engine: EngineOpt = None,
    negative_prompt: Annotated[str | None, typer.Option(help="What to steer away from.")] = None,
    steps: Annotated[int, typer.Option(min=1, help="Denoising steps.")] = 20,
    guidance: Annotated[float, typer.Option(help="Classifier-free guidance scale.")] = 7.5,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same image.")] = 0,
    height: Annotated[int | None, typer.Option(help="Image height in pixels (default: the model's).")] = None,
    width: Annotated[int | None, typer.Option(help="Image width in pixels (default: the model's).")] = None,
    scheduler: SchedulerOpt = None,
    out: Annotated[Path, typer.Option(help="Where to write the PNG.")] = Path("image.png"),
) -> None:
    """Generate an image, with the UNet on an engine (or on PyTorch without --engine).

    Example: sdtrt generate --engine engines/build-ort/2a06c39aaf814d52 --prompt "a red fox" --out fox.png
    """
    source = resolve_model(model)
    with step(f"Loading pipeline ({'engine ' + str(engine) if engine else 'PyTorch UNet'})"):
        pipe = load_pipeline(source, engine, scheduler=scheduler)
    request = GenerateRequest(prompt, negative_prompt, steps, guidance, seed, height, width)
    columns = (TextColumn("Denoising"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("steps", total=steps)
        result = generate(pipe, request, on_step=lambda i, total: progress.update(task, completed=i + 1, total=total))
    out.parent.mkdir(parents=True, exist_ok=True)
    result.images[0].save(out)
    typer.echo(out)


def validate_command(
    engine: Annotated[Path, typer.Option(help="Engine artifact (directory or file) to check.")],
    model: o.ModelOpt = "tiny",
    steps: Annotated[int, typer.Option(min=1, help="Denoising steps for the image comparison.")] = 10,
    scheduler: SchedulerOpt = None,
    images: Annotated[bool, typer.Option("--images/--no-images", help="Also compare generated images.")] = True,
    min_cosine: Annotated[float | None, typer.Option(help="Override: minimum cosine similarity.")] = None,
    max_abs: Annotated[float | None, typer.Option(help="Override: maximum absolute error.")] = None,
    min_psnr: Annotated[float | None, typer.Option(help="Override: minimum image PSNR in dB.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON.")] = None,
) -> None:
    """Compare an engine with the PyTorch fp32 UNet: tensors, latents and images. Exits 3 on a mismatch.

    Example: sdtrt validate --model tiny --engine engines/build-ort/2a06c39aaf814d52 --json report.json
    """
    config = ValidationConfig(
        steps=steps, scheduler=scheduler, images=images, min_cosine=min_cosine, max_abs=max_abs, min_psnr_db=min_psnr
    )
    report = validate(resolve_model(model), Artifact.open(engine), config)
    print_report(report)
    if json_out:
        json_out.write_text(json.dumps(report.to_json(), indent=2))
    report.raise_for_status()
    typer.echo("parity: PASS")


def print_report(report: ValidationReport) -> None:
    tol = report.tolerances
    table = Table(title=f"{report.precision} engine vs PyTorch fp32 ({report.model})", title_justify="left")
    for column in ("input", "max abs", "mean abs", "cosine", ""):
        table.add_column(column, justify="left" if column in ("input", "") else "right")
    for row in report.tensors:
        table.add_row(
            row["case"], f"{row['max_abs']:.3g}", f"{row['mean_abs']:.3g}", f"{row['cosine']:.6f}",
            "[red]FAIL[/]" if row["failures"] else "[green]ok[/]",
        )  # fmt: skip
    if report.image:
        lat = report.image["latents"]
        table.add_row(
            "final latents", f"{lat['max_abs']:.3g}", f"{lat['mean_abs']:.3g}", f"{lat['cosine']:.6f}",
            f"image PSNR {report.image['psnr_db']:.1f} dB",
        )  # fmt: skip
    console.print(table)
    console.print(f"tolerances: cosine ≥ {tol.min_cosine}, max abs ≤ {tol.max_abs}, PSNR ≥ {tol.min_psnr_db} dB")
    for failure in report.failures:
        console.print(f"[red]✗[/] {failure}")
