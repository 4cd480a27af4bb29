"""Progress for long steps: a live spinner on a terminal, one timed line per step otherwise.

Progress and notices go to stderr (``console``) so stdout stays for results (``results``; the CLI
prints an artifact's path last).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

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
