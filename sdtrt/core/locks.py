"""Locks between sdtrt processes: a run that must wait for another's says so, and names it."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.markup import escape

from .progress import console


@contextlib.contextmanager
def exclusive(path: Path, what: str) -> Iterator[None]:
    """An exclusive flock on ``path``, whose file holds the holder's pid while it is held. A run that has to wait
    says so in one line on stderr first: a compile waiting for another's stage (minutes) looked hung."""
    with open(path, "a+") as handle:  # not "w": a waiter would erase the holder's pid
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            pid = handle.read().strip()
            holder = f"another sdtrt run (pid {pid})" if pid.isdigit() else "another sdtrt run"
            console.print(
                f"[yellow]…[/] waiting: {holder} is making {escape(what)} (lock {escape(str(path))}); this run goes "
                "on when it is done"
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        _record(handle, str(os.getpid()))
        try:
            yield
        finally:
            _record(handle, "")
            fcntl.flock(handle, fcntl.LOCK_UN)


def _record(handle: TextIO, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text)
    handle.flush()
