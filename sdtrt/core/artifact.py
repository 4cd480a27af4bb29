"""A finished stage output (``Artifact``): its directory, its manifest, the artifacts it was made from, and whether
its files still match the manifest."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ArtifactError, ArtifactNotFoundError
from .integrity import VERIFIED, _read_signatures, _signature, _write_signatures, file_sha256
from .stage_request import MANIFEST_FORMAT, digest

MANIFEST = "manifest.json"


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
        """How an artifact made from this one records it. A bare .onnx is recorded by its file, which opens as the same
        artifact again (its folder has no manifest): what ``lineage`` reads."""
        where = self.primary if self.stage == "external" else self.path
        return {"kind": "artifact", "stage": self.stage, "digest": self.key, "path": str(where.resolve())}

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


# (file, mtime, size) of an .onnx and its data files → their key: ``lineage`` opens a bare .onnx at every call, and
# hashing a large graph each time is what would cost.
_EXTERNAL_KEYS: dict[tuple[tuple[str, int, int], ...], str] = {}


def external_onnx_manifest(path: Path) -> dict[str, Any]:
    """A manifest for an .onnx made outside sdtrt, keyed by the content of it and its data files."""
    files = [path, *sorted(path.parent.glob(path.name + ".data"))]
    seen = tuple((str(f.resolve()), (s := f.stat()).st_mtime_ns, s.st_size) for f in files)
    if seen not in _EXTERNAL_KEYS:
        _EXTERNAL_KEYS[seen] = digest([file_sha256(f) for f in files])
    return {"format": MANIFEST_FORMAT, "stage": "external", "key": _EXTERNAL_KEYS[seen], "primary": path.name,
            "files": []}  # fmt: skip


def describe_files(folder: Path) -> list[dict[str, Any]]:
    return [
        {"name": str(f.relative_to(folder)), "size": f.stat().st_size, "sha256": file_sha256(f)}
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name not in (MANIFEST, VERIFIED)
    ]
