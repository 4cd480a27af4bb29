"""Where a command writes its results (--json, --chart, --time-file, --out): each path made, or refused, before the
run."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import RequestError


def ensure_parent(path: Path | None, option: str) -> None:
    """Make the folder a results file (--json, --chart, --time-file, generate's --out) goes into, before the run,
    or refuse (exit 2) when it cannot be made: results are written after the whole run and must not be lost then."""
    if path is None:
        return
    if path.is_dir():
        raise RequestError(f"{option} {path} is a directory; pass a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RequestError(f"{option} {path}: cannot make its folder ({exc.strerror}); pass another path") from exc
    check_folder(path.parent, option, path)


def check_folder(folder: Path, option: str, given: Path | None = None) -> None:
    """RequestError (exit 2) unless ``folder`` is a writable folder or can be made as one (profile's --out, made
    when its results are written; or the folder of the file ``given``)."""
    given = given or folder
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise RequestError(f"{option} {given}: {existing} is a file, not a folder; pass another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        its = "its folder " if existing != given else ""
        raise RequestError(f"{option} {given}: {its}{existing} is not writable; pass another path")


def ensure_image_file(path: Path, option: str) -> None:
    """``ensure_parent`` for an image file, whose extension must name a format Pillow writes (it picks the format by
    extension, so a missing or unknown one failed after the whole generation)."""
    from PIL import Image

    Image.init()  # registers every plugin's extensions
    if path.is_dir():
        raise RequestError(f"{option} {path} is a folder; name a .png (or .jpg, .webp) file in it")
    if Image.registered_extensions().get(path.suffix.lower()) not in Image.SAVE:
        what = f"'{path.suffix}' is not an image format Pillow writes" if path.suffix else "it has no extension"
        raise RequestError(f"{option} {path}: {what}; name a .png (or .jpg, .webp) file")
    ensure_parent(path, option)
