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
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from .config import as_dict, cache_key
from .errors import ArtifactError, ArtifactNotFoundError, StoreError
from .locks import exclusive
from .progress import console

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TMP_DIR = ".tmp"
LOCK_DIR = ".locks"
LOG_DIR = "logs"  # logs of failed builds, kept for the user
VERIFIED = ".verified.json"  # stat signatures of the files as they last hashed clean


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_root(engines: Path | str | None = None) -> Path:
    """--engines DIR, else $SDTRT_ENGINES, else ./engines."""
    return Path(engines or os.environ.get("SDTRT_ENGINES") or "engines")


def environment(*packages: str) -> dict[str, str]:
    """Versions of the named distributions (and Python): the parts of a key no config shows."""
    env = {"python": platform.python_version()}
    for name in packages:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            env[name] = "absent"
    return env


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class StageRequest:
    """What a stage is asked to produce; its key names the artifact before any work is done."""

    stage: str
    version: int
    config: Any  # a frozen config dataclass from sdtrt.core.config
    inputs: list[dict[str, Any]]  # each has "digest": a model digest or an upstream artifact key
    environment: dict[str, str]

    @property
    def key(self) -> str:
        return digest(
            {
                "stage": self.stage,
                "version": self.version,
                "config": cache_key(self.config),
                "inputs": [i["digest"] for i in self.inputs],
                "environment": self.environment,
            }
        )

    def base_manifest(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "stage": self.stage,
            "stage_version": self.version,
            "key": self.key,
            "config": as_dict(self.config),
            "config_key": cache_key(self.config),
            "inputs": self.inputs,
            "environment": self.environment,
        }


@dataclass(frozen=True)
class Artifact:
    """A finished stage output: a directory and its manifest."""

    path: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def key(self) -> str:
        return str(self.manifest["key"])

    @property
    def stage(self) -> str:
        return str(self.manifest["stage"])

    @property
    def primary(self) -> Path:
        """The artifact's main file (the .onnx, the .plan, …)."""
        return self.path / self.manifest["primary"]

    def mark_used(self) -> None:
        """Record a use now (the manifest's mtime), which `gc --older-than` reads; a read-only store keeps none."""
        with contextlib.suppress(OSError):
            os.utime(self.path / MANIFEST)

    def as_input(self) -> dict[str, Any]:
        return {"kind": "artifact", "stage": self.stage, "digest": self.key, "path": str(self.path.resolve())}

    def lineage(self) -> list[Artifact]:
        """This artifact and the ones it was made from, newest first, back to the one made from a model."""
        chain = [self]
        while (first := (chain[-1].manifest.get("inputs") or [{}])[0]).get("kind") == "artifact":
            chain.append(Artifact.open(located(Path(first["path"]), chain[-1].path.parent.parent)))
        return chain

    def component(self) -> str:
        """The network its graph records; a weight map's is its graph's, a set's (and its validation report's) "set"
        ("?" where an ancestor is gone)."""
        try:
            for made in self.lineage():
                if made.stage == "set":
                    return "set"
                if "io" in made.manifest:
                    return str(made.manifest["io"]["component"])
        except ArtifactError:
            return "?"
        return "unet"

    def file_problems(self, rehash: bool = False) -> list[str]:
        """How the files differ from the manifest ([] when intact).

        Sizes are always compared; contents are hashed where a file changed on disk since it last
        hashed clean, or everywhere with ``rehash``. A clean result is recorded (where writable).
        """
        entries = self.manifest.get("files", [])
        recorded = {} if rehash else _read_signatures(self.path)
        problems, signatures = [], {}
        for entry in entries:
            f = self.path / entry["name"]
            if not f.is_file():
                problems.append(f"{entry['name']} is missing")
                continue
            signature = _signature(f)
            if signature[0] != entry["size"]:
                problems.append(f"{entry['name']} has {signature[0]} bytes, the manifest {entry['size']}")
            elif recorded.get(entry["name"]) != signature and file_sha256(f) != entry["sha256"]:
                problems.append(f"{entry['name']} differs from the manifest (sha256)")
            signatures[entry["name"]] = signature
        if not problems and entries and signatures != recorded:
            _write_signatures(self.path, signatures)
        return problems

    def require_intact(self) -> None:
        """ArtifactError, naming the first problem and how to rebuild, unless the files match the manifest."""
        if problems := self.file_problems():
            raise ArtifactError(
                f"artifact {self.path} is corrupt: {problems[0]}; rebuild it with "
                f"`{self.manifest.get('reproduce', 'the stage that made it')}` "
                "(and `sdtrt cache gc --corrupt` removes corrupt artifacts)"
            )

    @classmethod
    def open(cls, path: Path | str) -> Artifact:
        """An artifact from its directory, its manifest, or any file inside it.

        A bare .onnx outside the store becomes an ``external`` artifact keyed by its content.
        """
        path = Path(path)
        if not path.exists():
            raise ArtifactError(f"'{path}' does not exist; pass an artifact directory or its .onnx file")
        folder = path if path.is_dir() else path.parent
        manifest_path = folder / MANIFEST
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text())
            except json.JSONDecodeError as exc:
                raise ArtifactError(f"{manifest_path} is not valid JSON ({exc}); rebuild this artifact") from exc
            return cls(folder, manifest)
        if path.is_file() and path.suffix == ".onnx":
            return cls(folder, external_onnx_manifest(path))
        raise ArtifactNotFoundError(
            f"'{path}' is not an sdtrt artifact (no {MANIFEST}); pass the directory a stage printed, or an .onnx file"
        )


def located(recorded: Path, store_root: Path) -> Path:
    """Where an artifact recorded at ``recorded`` (``<root>/<stage>/<key>``) is, seen from the store at ``store_root``:
    its stage and key there when that is an artifact (a store moved elsewhere, a Triton repository that `sdtrt
    deploy` wrote), else the recorded path."""
    beside = store_root / recorded.parent.name / recorded.name
    return beside if (beside / MANIFEST).is_file() else recorded


def external_onnx_manifest(path: Path) -> dict[str, Any]:
    """A manifest for an .onnx made outside sdtrt, keyed by the content of it and its data files."""
    files = [path, *sorted(path.parent.glob(path.name + ".data"))]
    return {
        "format": MANIFEST_FORMAT,
        "stage": "external",
        "key": digest([file_sha256(f) for f in files]),
        "primary": path.name,
        "files": [],
    }


def describe_files(folder: Path) -> list[dict[str, Any]]:
    return [
        {"name": str(f.relative_to(folder)), "size": f.stat().st_size, "sha256": file_sha256(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name not in (MANIFEST, VERIFIED)
    ]


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

    def produce(self, request: StageRequest, build: Callable[[Path], dict[str, Any]]) -> tuple[Artifact, bool]:
        """The artifact for ``request``: from the store if present, else built by ``build(tmp_dir)``.

        ``build`` writes files into the temp directory and returns manifest fields (``primary``,
        ``io``, ``details``, …). Returns the artifact and whether it was a cache hit.
        """
        if hit := self._intact_hit(request):  # a read-only store serves its hits
            return hit, True
        self.ensure_writable()
        with exclusive(self.root / LOCK_DIR / f"{request.key[:16]}.lock", f"{request.stage} {request.key[:16]}"):
            if hit := self._intact_hit(request, quiet=True):  # a concurrent run finished it while we waited
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
                if final.exists():  # a corrupt artifact, or a manifest-less leftover from an older layout
                    shutil.rmtree(final)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        return Artifact(final, manifest), False

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
