"""The ``sdtrt`` command line: thin over the library, one module per command group.

Errors are one line on stderr (exit 1; parity failures exit 3; usage errors exit 2). Set
SDTRT_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import os
import sys
import warnings


def _quiet_third_party() -> None:
    """Exporters and hub libraries print warnings and bars the user cannot act on.

    Runs before the command modules import diffusers/transformers, which read these at import.
    SDTRT_DEBUG=1 keeps everything.
    """
    warnings.filterwarnings("ignore")
    for name, value in (
        ("TRANSFORMERS_VERBOSITY", "error"),
        ("DIFFUSERS_VERBOSITY", "error"),
        ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
        ("TQDM_DISABLE", "1"),  # diffusers' and transformers' loading bars; sdtrt draws its own
    ):
        os.environ.setdefault(name, value)


DEBUG = os.environ.get("SDTRT_DEBUG", "") not in ("", "0")
if not DEBUG:
    _quiet_third_party()

from typing import Annotated  # noqa: E402

import typer  # noqa: E402
from rich.markup import escape  # noqa: E402

from .. import __version__  # noqa: E402
from ..errors import SdtrtError, one_line  # noqa: E402
from ..progress import console  # noqa: E402

# Command modules import torch, diffusers and onnx inside their commands only, so that `--help`,
# `cache` and cache hits start in a fraction of a second.
from . import cache, debug, lora, perf, run, serve, stages  # noqa: E402

app = typer.Typer(
    name="sdtrt",
    help="Make Stable Diffusion fast on NVIDIA GPUs: export, simplify, build and validate engines of every network.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"sdtrt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Make Stable Diffusion fast on NVIDIA GPUs: export, simplify, build and validate engines of every network."""


stages.register(app)
run.register(app)
perf.register(app)
debug.register(app)
serve.register(app)
app.add_typer(cache.app, name="cache")
app.add_typer(lora.app, name="lora")


def main() -> None:
    try:
        app()
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
