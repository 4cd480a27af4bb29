"""``sdtrt cache``: list, verify and clean the artifact store."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ..errors import ArtifactError
from ..progress import console
from ..store import Store
from .options import EnginesOpt

app = typer.Typer(help="Inspect and clean the artifact store.", no_args_is_help=True)


def _size_mb(files: list[dict[str, int]]) -> float:
    return sum(f["size"] for f in files) / 1e6


@app.command("ls")
def ls(engines: EnginesOpt = None) -> None:
    """List artifacts: stage, key, size, what they were made from.

    Example: sdtrt cache ls --engines engines/
    """
    store = Store(engines)
    table = Table("stage", "key", "size (MB)", "created", "from", "path")
    for a in store.artifacts():
        source = a.manifest["inputs"][0] if a.manifest.get("inputs") else {}
        table.add_row(
            a.stage, a.key[:16], f"{_size_mb(a.manifest['files']):.1f}", a.manifest.get("created_at", "?"),
            source.get("name") or source.get("stage", "?"), str(a.path),
        )  # fmt: skip
    if table.row_count:
        console.print(table)
    typer.echo(f"{table.row_count} artifacts in {store.root}")


@app.command()
def verify(engines: EnginesOpt = None) -> None:
    """Re-hash every artifact's files against its manifest; exit 1 if any is corrupt.

    Example: sdtrt cache verify
    """
    results = Store(engines).verify()
    for r in results:
        status = "ok" if r else "CORRUPT: " + "; ".join(r.problems)
        typer.echo(f"{r.artifact.stage:10s} {r.artifact.key[:16]}  {status}")
    bad = [r for r in results if not r]
    if bad:
        raise ArtifactError(
            f"{len(bad)} of {len(results)} artifacts are corrupt; delete their directories and re-run the stages "
            "that made them"
        )
    typer.echo(f"{len(results)} artifacts verified")


@app.command()
def gc(
    engines: EnginesOpt = None,
    older_than: Annotated[float | None, typer.Option(help="Also remove artifacts unused for this many days.")] = None,
    dry_run: Annotated[bool, typer.Option(help="Only list what would be removed.")] = False,
) -> None:
    """Remove what interrupted runs left behind (and, with --older-than, stale artifacts).

    Example: sdtrt cache gc --older-than 30 --dry-run
    """
    removed = Store(engines).gc(older_than_days=older_than, dry_run=dry_run)
    for path in removed:
        typer.echo(("would remove " if dry_run else "removed ") + str(path))
    typer.echo(f"{len(removed)} entries {'to remove' if dry_run else 'removed'}")
