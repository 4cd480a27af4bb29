"""The ``sdtrt`` Typer app, before any command is registered: command modules and the package assemble onto it.

Importing it first quiets the third-party libraries (they read their switches at import).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Annotated

import typer

from .. import __version__


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
# Without a terminal rich lays help out in 80 columns and cuts option names ("--optimization-l…"); typer reads
# TERMINAL_WIDTH when it first formats help. On a terminal its own width rules.
if not sys.stdout.isatty():
    os.environ.setdefault("TERMINAL_WIDTH", "160")


def _flags_show_no_value() -> None:
    """typer 0.29's rich help gives every option a value column, flags too (``--help <bool>``, ``--static <bool>``),
    though a flag takes none (``--static true`` is refused); its plain help leaves flags out (core.py,
    TyperOption.get_help_record), as this does for the rich one."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None:  # a typer without it draws no value column
        return

    def display_type_rich(self: TyperOption, ctx: object) -> str | None:
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_show_no_value()

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
