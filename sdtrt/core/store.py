"""Content-addressed artifact store.

Every stage output is a directory ``<root>/<stage>/<key[:16]>/`` holding its files and a
``manifest.json``. The key is the sha256 of the stage, its version, the config fields that change the
output, the input identities (model digest or upstream artifact key) and the library versions that
matter, so any upstream change yields a new key and an unchanged re-run is a cache hit.

Writes are atomic: a stage builds in ``<root>/.tmp/…`` and the finished directory is renamed into
place, manifest included, in one step. An interrupted stage leaves only a temp directory, which no
lookup ever returns and ``gc`` removes. Concurrent runs of the same key serialise on a lock file (locks.py); the
second says which run it waits for, then finds the first's artifact.

A cache hit never hands out files that differ from their manifest: sizes are checked on every hit,
and content hashes whenever a file's stat signature (size, mtime, inode) differs from the one
recorded when it last hashed clean (``.verified.json`` beside the manifest, as git's index does). A
corrupt hit is rebuilt.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .artifact import MANIFEST, Artifact, describe_files
from .errors import ArtifactError, ArtifactNotFoundError, StoreError
from .integrity import _signature, _write_signatures
from .locks import exclusive
from .progress import console
from .stage_request import StageRequest

TMP_DIR = ".tmp"
LOCK_DIR = ".locks"
LOG_DIR = "logs"  # logs of failed builds, kept for the user


def default_root(engines: Path | str | None = None) -> Path:
    """--engines DIR, else $SDTRT_ENGINES, else ./engines."""
    return Path(engines or os.environ.get("SDTRT_ENGINES") or "engines")


@dataclass(frozen=True)
class VerifyResult:
    artifact: Artifact
    problems: list[str]

    def __bool__(self) -> bool:
        return not self.problems


class Store:
    def __init__(self, root: Path | str | None = None) -> None:
        self.root = default_root(root).expanduser()
        self.reused: set[Path] = set()  # the artifacts this object served from the cache, said so once (the CLI)

    # ---- reading ------------------------------------------------------------------------------

    def artifact_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key[:16]

    def lookup(self, request: StageRequest) -> Artifact | None:
        folder = self.artifact_dir(request.stage, request.key)
        if not (folder / MANIFEST).is_file():
            return None
        artifact = Artifact.open(folder)
        return artifact if artifact.key == request.key else None

    def artifacts(self) -> list[Artifact]:
        if not self.root.is_dir():
            return []
        found = []
        for manifest in sorted(self.root.glob(f"*/*/{MANIFEST}")):
            if manifest.parts[-3].startswith("."):
                continue
            with contextlib.suppress(ArtifactError):
                found.append(Artifact.open(manifest.parent))
        return found

    def verify(self) -> list[VerifyResult]:
        """Re-hash every artifact's files against its manifest."""
        return [VerifyResult(a, a.file_problems(rehash=True)) for a in self.artifacts()]

    def find(self, ref: str | Path) -> Artifact:
        """An artifact by path, or by its key as `cache ls` shows it (``KEY`` or ``STAGE/KEY``, a prefix will do)."""
        if Path(ref).exists():
            return Artifact.open(ref)
        stage, _, key = str(ref).rpartition("/")
        if re.fullmatch(r"[0-9a-f]{4,64}", key):
            found = [a for a in self.artifacts() if a.key.startswith(key) and stage in ("", a.stage)]
            if len(found) == 1:
                return found[0]
            if found:
                raise ArtifactNotFoundError(
                    f"'{ref}' matches {len(found)} artifacts in {self.root}; give more of the key"
                )
        raise ArtifactNotFoundError(
            f"'{ref}' does not exist and is not an artifact key in {self.root}; pass the directory a stage "
            "printed, or a key from `sdtrt cache ls` (with --engines DIR for another store)"
        )

    # ---- writing ------------------------------------------------------------------------------

    def require_folder(self) -> None:
        """StoreError unless the root is a folder: a file, or nothing there, is no store to read (listing it would
        show an empty store)."""
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"engines path '{self.root}' is a file, not a directory; pass --engines DIR")
        if not self.root.exists():
            raise StoreError(
                f"engines directory '{self.root}' does not exist; pass --engines DIR (the folder a compile wrote to) "
                "or set SDTRT_ENGINES"
            )

    def ensure_writable(self) -> None:
        """Fail early, before any expensive work, when the store cannot take a new artifact."""
        if self.root.exists():
            self.require_folder()
        try:
            (self.root / TMP_DIR).mkdir(parents=True, exist_ok=True)
            (self.root / LOCK_DIR).mkdir(exist_ok=True)
            with tempfile.TemporaryFile(dir=self.root / TMP_DIR):
                pass
        except OSError as exc:
            raise StoreError(
                f"engines directory '{self.root}' is not writable ({exc.strerror}); "
                "pass --engines DIR or set SDTRT_ENGINES to a writable folder"
            ) from exc

    def produce(
        self, request: StageRequest, build: Callable[[Path], dict[str, Any]], rebuild: bool = False
    ) -> tuple[Artifact, bool]:
        """The artifact for ``request``: from the store if present, else built by ``build(tmp_dir)``.

        ``build`` writes files into the temp directory and returns manifest fields (``primary``,
        ``io``, ``details``, …). Returns the artifact and whether it was a cache hit. ``rebuild``: built even over an
        intact one, which it replaces (a validation run again is the verdict to keep).
        """
        if not rebuild and (hit := self._intact_hit(request)):  # a read-only store serves its hits
            return hit, True
        self.ensure_writable()
        with exclusive(self.root / LOCK_DIR / f"{request.key[:16]}.lock", f"{request.stage} {request.key[:16]}"):
            if not rebuild and (hit := self._intact_hit(request, quiet=True)):  # a concurrent run finished it
                return hit, True
            tmp = Path(
                tempfile.mkdtemp(prefix=f"{request.stage}-{request.key[:12]}-{os.getpid()}-", dir=self.root / TMP_DIR)
            )
            try:
                tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; artifacts follow the umask like other files
                started = time.time()
                fields = build(tmp)
                follow_umask(tmp)
                manifest = request.base_manifest() | fields
                manifest["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
                manifest.setdefault("timings", {})["stage_s"] = round(time.time() - started, 3)
                manifest["files"] = describe_files(tmp)
                _write_signatures(tmp, {entry["name"]: _signature(tmp / entry["name"]) for entry in manifest["files"]})
                _write_json_synced(tmp / MANIFEST, manifest)
                final = self.artifact_dir(request.stage, request.key)
                final.parent.mkdir(parents=True, exist_ok=True)
                if final.exists():  # rebuilt, a corrupt artifact, or a manifest-less leftover from an older layout
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return Artifact(final, manifest), False

    def stored(self, request: StageRequest) -> Artifact | None:
        """The intact artifact stored for ``request``, or None; nothing is built or said."""
        hit = self.lookup(request)
        return hit if hit is not None and not hit.file_problems() else None

    def lock(self, name: str, what: str) -> contextlib.AbstractContextManager[None]:
        """An exclusive lock named ``name`` in the store, for work that spans several artifacts (``what`` it is, to
        a run that waits)."""
        self.ensure_writable()
        return exclusive(self.root / LOCK_DIR / f"{name}.lock", what)

    @contextlib.contextmanager
    def scratch(self, name: str) -> Iterator[Path]:
        """A folder in the store's temp area for files that several artifacts are made from (moved out of it into
        each), removed on exit; ``gc`` removes one whose process died."""
        self.ensure_writable()
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-{os.getpid()}-", dir=self.root / TMP_DIR))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _intact_hit(self, request: StageRequest, quiet: bool = False) -> Artifact | None:
        """The stored artifact for ``request`` if its files match its manifest; a corrupt one is reported."""
        hit = self.lookup(request)
        if hit is None:
            return None
        if problems := hit.file_problems():
            if not quiet:
                console.print(
                    f"[yellow]![/] cached {request.stage} artifact {hit.path} is corrupt: {problems[0]}; rebuilding"
                )
            return None
        hit.mark_used()
        console.print(f"[green]✓[/] {request.stage}: cached {hit.component()} [dim]({hit.path})[/]")
        self.reused.add(hit.path)
        return hit

    def keep_log(self, log: Path, name: str) -> Path:
        """Copy a failed stage's log out of its temp directory (which is removed) into <root>/logs/."""
        kept = self.root / LOG_DIR / name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, kept)
        return kept

    def gc(self, older_than_days: float | None = None, corrupt: bool = False, dry_run: bool = False) -> GcResult:
        """Remove what interrupted runs left, and (if asked) artifacts unused for N days or corrupt."""
        doomed = []
        tmp_root = self.root / TMP_DIR
        if tmp_root.is_dir():
            doomed += [d for d in tmp_root.iterdir() if d.is_dir() and not _owner_alive(d.name)]
        for stage_dir in self.root.glob("[!.]*"):
            if not stage_dir.is_dir() or stage_dir.name == LOG_DIR:
                continue
            for folder in stage_dir.iterdir():
                if not folder.is_dir():
                    continue
                manifest = folder / MANIFEST
                if not manifest.is_file() or (
                    older_than_days is not None and time.time() - manifest.stat().st_mtime > older_than_days * 86400
                ):
                    doomed.append(folder)
        if corrupt:
            doomed += [r.artifact.path for r in self.verify() if not r and r.artifact.path not in doomed]
        if dry_run:
            return GcResult(removed=doomed, failed=[])
        result = GcResult(removed=[], failed=[])
        for folder in doomed:
            try:
                doomed_now = folder
                if folder.parent != tmp_root:
                    # Out of sight in one step: an artifact is never left half-deleted where lookups see it,
                    # and what rmtree cannot finish stays in .tmp for the next gc.
                    tmp_root.mkdir(exist_ok=True)
                    doomed_now = folder.rename(tmp_root / f"gc-{folder.name}-{os.getpid()}-{time.time_ns()}")
                shutil.rmtree(doomed_now)
                result.removed.append(folder)
            except OSError as exc:
                result.failed.append((folder, exc.strerror or str(exc)))
        return result


@dataclass(frozen=True)
class GcResult:
    removed: list[Path]  # with dry_run: what would be removed
    failed: list[tuple[Path, str]]  # folders that could not be removed, and why


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give the files a stage wrote the modes the umask gives new files: some writers are stricter (onnx ≥ 1.2x
    writes external data 0600), which a server under another account could not read."""
    mask = _umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = path.stat().st_mode
            path.chmod((0o666 | (mode & 0o111)) & ~mask)


def _owner_alive(tmp_name: str) -> bool:
    """Temp dirs are named ``stage-key-PID-random``; one whose process is gone was interrupted."""
    parts = tmp_name.split("-")
    if len(parts) < 2 or not parts[-2].isdigit():
        return False
    pid = int(parts[-2])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json_synced(path: Path, data: dict[str, Any]) -> None:
    with path.open("w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
