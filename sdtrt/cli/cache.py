"""``sdtrt cache``: list, verify and clean the artifact store. Results on stdout, one artifact a line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..core.artifact import Artifact
from ..core.errors import ArtifactError, RequestError, StoreError
from ..core.store import Store
from .store_options import EnginesOpt

app = typer.Typer(help="Inspect and clean the artifact store.", no_args_is_help=True)


def _store(engines: Path | None) -> Store:
    """The --engines store to read: a path that is no folder is a usage error (exit 2), not an empty store."""
    store = Store(engines)
    try:
        store.require_folder()
    except StoreError as exc:
        raise RequestError(str(exc)) from None
    return store


def _size_mb(files: list[dict[str, Any]]) -> float:
    return sum(f["size"] for f in files) / 1e6


def _family(artifact: Artifact) -> str:
    """The model family its export recorded ("?" where an ancestor is gone or predates families)."""
    try:
        return next((a.manifest["family"] for a in artifact.lineage() if "family" in a.manifest), "?")
    except ArtifactError:
        return "?"


def _made_from(source: dict[str, Any]) -> str:
    """An artifact's first input: the model's name, the adapter folder an image encoder came from, or a stage."""
    adapter = source.get("path") if source.get("kind") == "ip_adapter" else None
    return str(source.get("name") or adapter or source.get("stage", "?"))


@app.command("ls")
def ls(engines: EnginesOpt = None) -> None:
    """List artifacts, one a line: stage, key, component, model family, size, created, made from, path.

    Example: sdtrt cache ls --engines engines/ | grep build-ort
    """
    store = _store(engines)
    rows = [("stage", "key", "component", "family", "size MB", "created", "from", "path")]
    for a in store.artifacts():
        source = a.manifest["inputs"][0] if a.manifest.get("inputs") else {}
        rows.append((
            a.stage, a.key[:16], a.component(), _family(a), f"{_size_mb(a.manifest['files']):.1f}",
            a.manifest.get("created_at", "?"), _made_from(source), str(a.path),
        ))  # fmt: skip
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        for row in rows:
            typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    typer.echo(f"{len(rows) - 1} artifacts in {store.root}")


@app.command()
def verify(engines: EnginesOpt = None) -> None:
    """Re-hash every artifact's files against its manifest; exit 1 if any is corrupt.

    Example: sdtrt cache verify
    """
    results = _store(engines).verify()
    for r in results:
        status = "ok" if r else "CORRUPT: " + "; ".join(r.problems)
        typer.echo(f"{r.artifact.stage:10s} {r.artifact.key[:16]}  {status}")
    bad = [r for r in results if not r]
    if bad:
        raise ArtifactError(
            f"{len(bad)} of {len(results)} artifacts are corrupt; `sdtrt cache gc --corrupt` removes them, and the "
            "next run of the stages that made them rebuilds them"
        )
    typer.echo(f"{len(results)} artifacts verified")


@app.command()
def gc(
    engines: EnginesOpt = None,
    older_than: Annotated[float | None, typer.Option(help="Also remove artifacts unused for this many days.")] = None,
    corrupt: Annotated[bool, typer.Option("--corrupt", help="Also remove artifacts `cache verify` flags.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Only list what would be removed.")] = False,
) -> None:
    """Remove what interrupted runs left behind (and, if asked, stale or corrupt artifacts).

    Example: sdtrt cache gc --older-than 30 --dry-run
    """
    if older_than is not None and not older_than >= 0:  # -1 would list every artifact, as 0 does
        raise RequestError(f"--older-than {older_than}: a number of days must be 0 or more")
    result = _store(engines).gc(older_than_days=older_than, corrupt=corrupt, dry_run=dry_run)
    for path in result.removed:
        typer.echo(("would remove " if dry_run else "removed ") + str(path))
    typer.echo(f"{len(result.removed)} entries {'to remove' if dry_run else 'removed'}")
    if result.failed:
        path, why = result.failed[0]
        raise StoreError(
            f"{len(result.failed)} entries could not be removed, e.g. {path} ({why}); check the store's permissions"
        )
