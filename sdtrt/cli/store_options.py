"""Which model, which artifact store, which engine: the options that name them (--model, --engines, --engine),
declared once for every command, and how a command opens or finds what they name."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..core.artifact import Artifact
from ..core.errors import ArtifactNotFoundError, RequestError, StoreError
from ..core.store import Store
from ..sources.models import ModelSource
from ..sources.presets import PRESETS

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help=f"Preset ({', '.join(PRESETS)}), local diffusers folder, or hub id."),
]
# Commands that take an engine: the model defaults to the one the engine was made from.
EngineModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Preset, local diffusers folder, or hub id (default: the model the engine was made from; "
        "tiny without --engine).",
    ),
]
EnginesOpt = Annotated[
    Path | None,
    typer.Option("--engines", envvar="SDTRT_ENGINES", help="Artifact store directory (default: ./engines)."),
]
ENGINE_HELP = "Engine artifact: a directory or file a stage printed, or a key from `sdtrt cache ls` (KEY or STAGE/KEY)"
EngineOpt = Annotated[str | None, typer.Option(help=f"{ENGINE_HELP}; omit for plain PyTorch.")]


def open_store(engines: Path | None, cached_ok: bool = False) -> Store:
    """The --engines store, refused up front when it cannot take a new artifact; with ``cached_ok`` a
    read-only store is accepted: complete cache hits write nothing, and a miss fails before its stage runs."""
    store = Store(engines)
    try:
        store.ensure_writable()
    except StoreError:
        if not (cached_ok and store.root.is_dir()):
            raise
    return store


def find_engine(engine: str, engines: Path | None, option: str | None = "--engine") -> Artifact:
    """--engine (or the engine argument, ``option`` None) as a path or a key in the --engines store; one that names
    no artifact is a usage error (exit 2), one that names a broken artifact is not."""
    try:
        return Store(engines).find(engine)
    except ArtifactNotFoundError as exc:
        raise RequestError(f"{option} {exc}" if option else str(exc)) from None


def model_for(model: str | None, engine: Artifact | None) -> ModelSource:
    """``--model`` when given (checked against ``engine``: exit 2 when the engine was made from another model),
    else the model ``engine`` was made from, else the tiny preset."""
    from ..sources.models import resolve_model
    from ..stages.engine_set import check_pairing, engine_members, recorded_model

    if model:
        source = resolve_model(model)
        if engine is not None:
            check_pairing(engine_members(engine), source)
        return source
    return recorded_model(engine) if engine is not None else resolve_model("tiny")
