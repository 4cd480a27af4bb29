"""Whether files still match what a manifest recorded: content hashes, and the stat signatures recorded when the files
last hashed clean (``.verified.json`` beside the manifest), which spare re-hashing files unchanged on disk."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

VERIFIED = ".verified.json"  # stat signatures of the files as they last hashed clean


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _signature(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _read_signatures(folder: Path) -> dict[str, list[int]]:
    try:
        return dict(json.loads((folder / VERIFIED).read_text()))
    except (OSError, ValueError):
        return {}


def _write_signatures(folder: Path, signatures: dict[str, list[int]]) -> None:
    """Best effort: a read-only store simply re-hashes on every use."""
    with contextlib.suppress(OSError):
        (folder / VERIFIED).write_text(json.dumps(signatures))
