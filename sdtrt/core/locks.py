"""Locks between sdtrt processes: a run that must wait for another's says so, and names it; a file that processes
share (a cache in the store) is read and replaced whole under a lock beside it."""

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


# A file that processes read and replace whole (a cache in the store): each holds the flock of a lock file beside it,
# shared to read and exclusive to write, and a writer renames a complete temporary file over it, so a reader sees the
# old file or the new one, never part of one. NVIDIA's TensorRT-RTX demo keeps its runtime cache under a lock file the
# same way (demo/utils/engine.py, polygraphy.util.LockFile); TensorRT's samples update their timing cache under one
# (shared/utils/cacheUtils.cpp updateTimingCacheFile).


def lock_beside(path: Path) -> Path:
    """The lock file of ``path``'s readers and writers: ``.NAME.lock`` in its folder (the file itself is replaced)."""
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def locked_beside(path: Path, shared: bool = False) -> Iterator[None]:
    """Hold ``path``'s lock (lock_beside): shared to read it; exclusive to write it, so that no other writer comes
    between what a writer reads and the file it puts in its place (replace_file). A writer's folder is made first.
    The lock is released when the block ends (its file closes)."""
    if not shared:
        path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_beside(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield


def replace_file(path: Path, data: bytes) -> None:
    """Put ``data`` in ``path``'s place whole: written to a temporary file beside it (this process's own name), then
    renamed over it (os.replace: atomic on POSIX). Call it under locked_beside(path)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        tmp.replace(path)
    except BaseException:  # a full disk, an interrupt: no half-written temporary file left beside it
        tmp.unlink(missing_ok=True)
        raise


def replace_locked(path: Path, data: bytes) -> None:
    """Replace the file with ``data`` whole, under its exclusive lock."""
    with locked_beside(path):
        replace_file(path, data)


def read_locked(path: Path) -> bytes:
    """The file's bytes, read under its shared lock (b"" when it is not there)."""
    if not path.is_file():
        return b""
    try:
        with locked_beside(path, shared=True):
            return path.read_bytes()
    except OSError:  # a read-only store: no lock file can be made, and no writer can replace the file there
        return path.read_bytes()
