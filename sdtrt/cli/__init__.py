"""The ``sdtrt`` command line: thin over the library, one module per command group.

Errors are one line on stderr (exit 1; parity failures exit 3; usage errors exit 2). Set
SDTRT_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer

from ..errors import SdtrtError
from ..progress import console
from . import cache, stages

app = typer.Typer(
    name="sdtrt",
    help="Make Stable Diffusion fast on NVIDIA GPUs: export, simplify, build and validate UNet engines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
stages.register(app)
app.add_typer(cache.app, name="cache")


def main() -> None:
    debug = os.environ.get("SDTRT_DEBUG", "") not in ("", "0")
    if not debug:
        _quiet_third_party()
    try:
        app()
    except SdtrtError as exc:
        if debug:
            raise
        console.print(f"[red]error:[/] {exc}", markup=True, soft_wrap=True)
        sys.exit(exc.exit_code)
    except Exception as exc:  # an sdtrt bug or a library failure we did not anticipate
        if debug:
            raise
        console.print(
            f"[red]error:[/] unexpected {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
            "(run with SDTRT_DEBUG=1 for the traceback, and please report it)",
            soft_wrap=True,
        )
        sys.exit(1)


def _quiet_third_party() -> None:
    """Exporter and hub libraries warn a lot about things the user cannot act on."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
