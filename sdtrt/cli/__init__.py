"""The ``sdtrt`` command line: thin over the library, one module per command group, assembled here.

The Typer app lives in app.py; each command module registers its commands on it, and ``main`` runs it.

Errors are one line on stderr (exit 1; parity failures exit 3; usage errors exit 2). Set
SDTRT_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import sys

from rich.markup import escape

from ..core.errors import SdtrtError, one_line
from ..core.progress import console
from .app import DEBUG, app  # first of the CLI's modules: it quiets third-party libraries before they load

# isort: split
# Command modules import torch, diffusers and onnx inside their commands only, so that `--help`,
# `cache` and cache hits start in a fraction of a second.
from . import cache, compile, debug, ip_adapter, lora, perf, report, run, serve, stages, step_cache

stages.register(app)
compile.register(app)
run.register(app)
perf.register(app)
step_cache.register(app)
debug.register(app)
report.register(app)
serve.register(app)
app.add_typer(cache.app, name="cache")
app.add_typer(lora.app, name="lora")
app.add_typer(ip_adapter.app, name="ip-adapter")


def main() -> None:
    try:
        app()
    except SystemExit as exc:
        if interrupted(exc):
            console.print(f"[yellow]interrupted[/]: {interrupted_note(sys.argv[1:])}", soft_wrap=True)
        raise
    except SdtrtError as exc:
        if DEBUG:
            raise
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # an sdtrt bug or a library failure we did not anticipate
        if DEBUG:
            raise
        console.print(
            f"[red]error:[/] unexpected {type(exc).__name__}: {escape(one_line(exc))} "
            "(run with SDTRT_DEBUG=1 for the traceback, and please report it)",
            soft_wrap=True,
        )
        sys.exit(1)


# Commands that build no stage of their own: they write their results (an image, a report) only at the end.
RESULT_COMMANDS = ("generate", "validate", "profile", "debug", "check-blocks")


def interrupted_note(args: list[str]) -> str:
    """What Ctrl-C left behind, for the command in ``args`` (the command line after ``sdtrt``)."""
    command = next((arg for arg in args if not arg.startswith("-")), "")
    if command in RESULT_COMMANDS:
        return f"{command} stopped before writing its results"
    return (
        "nothing half-written was kept (an unfinished stage's temporary folder is removed); stages that finished "
        "stay cached for the next run"
    )


def interrupted(exc: BaseException) -> bool:
    """Whether Ctrl-C ended the command: Typer turns the KeyboardInterrupt into a silent exit 130
    (typer/core.py, _main: ``raise Exit(130) from e``), which this exit was raised while handling."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
