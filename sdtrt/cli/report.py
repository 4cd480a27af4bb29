"""``sdtrt report``: one self-contained HTML page of what is known about an engine (or set)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ..core.progress import console
from . import result_files, store_options

if TYPE_CHECKING:
    from ..core.artifact import Artifact
    from ..core.store import Store
    from ..tools.validate import ValidationReport

ReportOpt = Annotated[
    bool,
    typer.Option(
        "--report/--no-report",
        help="Also write the validation's HTML report (images side by side, drift over steps, parity, precision; see "
        "`sdtrt report`) next to its JSON: the stored report.json (compile), the --json file (validate; none without "
        "--json).",
    ),
]


def register(app: typer.Typer) -> None:
    app.command(name="report")(report_command)


def report_command(
    engine: Annotated[str, typer.Argument(help=f"{store_options.ENGINE_HELP}.")],
    out: Annotated[Path, typer.Option(help="Where to write the HTML file.")] = Path("report.html"),
    validation: Annotated[
        list[Path] | None,
        typer.Option(
            metavar="FILE",
            help="A `sdtrt validate --json` file (numbers only: its images are not in it); repeat for several.",
        ),
    ] = None,
    debug: Annotated[
        Path | None, typer.Option(help="A `sdtrt debug --json` file: error per layer along the graph.")
    ] = None,
    bench: Annotated[
        Path | None, typer.Option(help="A `sdtrt bench --json` file: the stage breakdown per backend.")
    ] = None,
    profile: Annotated[
        Path | None, typer.Option(help="A `sdtrt profile --out` folder: per-step latencies and links to its traces.")
    ] = None,
    engines: store_options.EnginesOpt = None,
) -> None:
    """Write one self-contained HTML report of an engine or set: it opens from a file in any browser, no network.

    It shows what exists: the images of every validation stored with the engines (compile's) side by side with
    PyTorch's and their difference, the latents' drift over the denoising steps, the per-component parity table
    (failures first), each member's precision, and with --debug, --bench, --profile where the error starts and where
    the time goes; then the model, member keys, versions and the commands that make it again.

    Example: sdtrt report engines/set/2a06c39aaf814d52 --debug debug.json --bench bench.json --out report.html
    """
    from ..core.store import Store
    from ..tools.report import ReportConfig, write_report

    result_files.ensure_parent(out, "--out")
    artifact = store_options.find_engine(engine, engines, option=None)
    config = ReportConfig(out, tuple(validation or ()), debug, bench, profile)
    console.print(f"[dim]writing the report of {escape(engine)}[/]", soft_wrap=True)
    typer.echo(write_report(artifact, Store(artifact.path.parent.parent), config))


def write_validation_report(
    report: ValidationReport, engine: Artifact, store: Store | None, out: Path | None = None
) -> None:
    """The HTML report of ``engine``'s validation, beside its JSON: ``out``, else the report.html of the store's
    validate artifact that holds it. With ``store``, of every validation stored for the engine (this one among them),
    else of ``report`` alone. A by-product: what stops it (a read-only store, a damaged stored validation) is said in
    one line on stderr, and the command goes on with its own result."""
    from ..tools.report import REPORT_HTML, ReportConfig, write_report_or_warn

    if out is None:
        if report.stored_in is None:
            console.print(
                "[yellow]![/] report not written: the store is read-only, so no report.json was kept to write it "
                "beside; `sdtrt validate --json FILE` writes one elsewhere",
                soft_wrap=True,
            )
            return
        out = report.stored_in / REPORT_HTML
    if written := write_report_or_warn(engine, store, ReportConfig(out), () if store else (report,)):
        console.print(f"report: {escape(str(written))}", soft_wrap=True)  # one line, for a script to read
