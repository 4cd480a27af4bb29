"""Progress for long steps: a live spinner on a terminal, one timed line per step otherwise.

Progress and notices go to stderr (``console``) so stdout stays for results (``results``; the CLI
prints an artifact's path last).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape

# Logs and CI have no terminal width: 80 columns would truncate tables of paths, and a message wrapped
# into two lines cannot be grepped, so lines are never wrapped (soft_wrap). No emoji codes: rich would turn
# a ':abc:' in a message ("--lora a:abc: 'abc' is not a scale") into 🔤; markup in messages is escaped.
console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False, width=None if sys.stderr.isatty() else 160)
# Results (tables a command exists to print) go to stdout, so they can be piped and grepped.
results = Console(highlight=False, soft_wrap=True, emoji=False, width=None if sys.stdout.isatty() else 160)


@contextlib.contextmanager
def step(description: str) -> Iterator[None]:
    started = time.perf_counter()
    text = escape(description)  # it names paths, models and prompts, which may hold [brackets]
    with console.status(f"{text}…"):
        yield
    console.print(f"[green]✓[/] {text} [dim]({time.perf_counter() - started:.1f} s)[/]")


@contextlib.contextmanager
def counted_steps(description: str, total: int) -> Iterator[Callable[[int, int], None]]:
    """A bar of steps done on a terminal, one timed line otherwise (a log has no use for a bar's frames, and rich
    ends a transient bar off a terminal with a blank line). Yields ``on_step(index, total)``."""
    if not console.is_terminal:
        with step(f"{description} ({total} step{'' if total == 1 else 's'})"):
            yield lambda index, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn(escape(description)), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task(description, total=total)
        yield lambda index, total: progress.update(bar, completed=index + 1, total=total)


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No loading bars or notices from diffusers and transformers while sdtrt loads a model: it shows its own progress.

    Their switches are process-wide, so each is restored afterwards; SDTRT_DEBUG=1 keeps the bars.
    """
    if os.environ.get("SDTRT_DEBUG", "") not in ("", "0"):
        yield
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    restore = []
    for lib in (diffusers_logging, transformers_logging):
        if lib.is_progress_bar_enabled():
            lib.disable_progress_bar()
            restore.append(lib.enable_progress_bar)
        # Their loading notices (e.g. transformers' "requires torchvision … falling back") are not the user's to act on.
        level = lib.get_verbosity()
        lib.set_verbosity(lib.ERROR)
        restore.append(lambda lib=lib, level=level: lib.set_verbosity(level))
    try:
        yield
    finally:
        for undo in restore:
            undo()
