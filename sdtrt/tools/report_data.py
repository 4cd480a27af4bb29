"""What the HTML report shows, gathered from an engine (or set), its store and the results files of the tools that
ran on it: validations (stored beside the engines by compile, or `validate --json` files), `debug --json`,
`bench --json` and a `profile --out` folder. Each part is None or empty where its data does not exist.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.artifact import MANIFEST, Artifact
from ..core.errors import ArtifactError, RequestError
from ..core.progress import console
from ..core.store import Store
from .report_images import load_images
from .validate import REPORT, STAGE, ValidationReport

PROFILE_FILES = ("steps.json", "trace.json", "flame.speedscope.json")  # what `sdtrt profile --out` writes


@dataclass(frozen=True)
class ReportConfig:
    """Results made outside the store that the report reads too, and where it goes."""

    out: Path = Path("report.html")
    validations: tuple[Path, ...] = ()  # `sdtrt validate --json` files
    debug: Path | None = None  # `sdtrt debug --json`
    bench: Path | None = None  # `sdtrt bench --json`
    profile: Path | None = None  # a `sdtrt profile --out` folder

    def named_files(self) -> list[tuple[str, Path]]:
        """(option, path) of every results file given."""
        named: list[tuple[str, Path | None]] = [("--validation", p) for p in self.validations]
        named += [("--debug", self.debug), ("--bench", self.bench), ("--profile", self.profile)]
        return [(option, path) for option, path in named if path is not None]


@dataclass(frozen=True)
class Member:
    component: str
    stage: str
    key: str
    path: str
    precision: dict[str, Any]  # what its graph was exported in (and why), from its export manifest
    quantization: str | None  # "int8 level 2.5 (…)" where a quantize stage made it
    kept_high_precision: dict[str, str]  # layer → why quantization left it in high precision
    layer_types: dict[str, int]  # a TensorRT build's layers by the type they compute in


@dataclass
class ReportData:
    engine: Artifact
    members: list[Member]
    validations: list[ValidationReport] = field(default_factory=list)  # failing ones first
    validation_sources: list[str] = field(default_factory=list)  # where each was read, in the same order
    debug: dict[str, dict[str, Any]] = field(default_factory=dict)  # component → `debug --json`'s report
    bench: dict[str, Any] | None = None
    profile_steps: list[dict[str, Any]] = field(default_factory=list)
    traces: list[Path] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)  # library versions across the lineage
    reproduce: list[str] = field(default_factory=list)

    @property
    def model(self) -> dict[str, Any]:
        """The model the engines were made from: the set's record, else the first export's input, else the model a
        validation compared a bare graph with."""
        if recorded := self.engine.manifest.get("model"):
            return dict(recorded)
        for made in self.engine.lineage():
            first = (made.manifest.get("inputs") or [{}])[0]
            if first.get("kind") not in (None, "artifact"):
                return {"name": first.get("name", "?"), "kind": first["kind"], "path": first.get("path", "")}
        if self.validations:
            return {"name": self.validations[0].model, "kind": "compared with by validation"}
        return {"name": "?", "kind": "unknown"}


def gather(
    engine: Artifact, store: Store | None, config: ReportConfig, validations: Sequence[ValidationReport] = ()
) -> ReportData:
    """Everything the report can show about ``engine``: the ``validations`` given (with their images), those stored
    for it in ``store``, and the results files ``config`` names (a missing or unreadable one: RequestError)."""
    from ..stages.engine_set import engine_members

    members = engine_members(engine)
    data = ReportData(engine, [_member(component, artifact) for component, artifact in members.items()])
    found = [(v, "this run") for v in validations] + stored_validations(engine, store)
    for path in config.validations:
        given = _validation(_read_json(path, "--validation", dict), path)
        if _numbers(given) not in {_numbers(known) for known, _ in found}:  # not one stored with the engines again
            found.append((given, str(path)))
    found.sort(key=lambda pair: bool(pair[0]))  # failures first; stable, so the given ones lead among equals
    data.validations = [v for v, _ in found]
    data.validation_sources = [source for _, source in found]
    if config.debug:
        debugged = _read_json(config.debug, "--debug", dict)
        data.debug = {"engine": debugged} if "layers" in debugged or "first" in debugged else debugged
    if config.bench:
        data.bench = _read_json(config.bench, "--bench", dict)
    if config.profile:
        steps = config.profile / PROFILE_FILES[0]
        data.profile_steps = _read_json(steps, "--profile", list) if steps.is_file() else []
        data.traces = [config.profile / name for name in PROFILE_FILES[1:] if (config.profile / name).is_file()]
        if not steps.is_file() and not data.traces:
            raise RequestError(f"--profile {config.profile} holds none of {', '.join(PROFILE_FILES)}; pass the folder "
                               "`sdtrt profile --out` wrote")  # fmt: skip
    for made in [a for artifact in members.values() for a in artifact.lineage()]:
        data.environment |= made.manifest.get("environment", {})
    data.reproduce = [engine.manifest["reproduce"]] if engine.manifest.get("reproduce") else []
    data.reproduce += sorted({f"sdtrt validate --engine {v.engine}" for v in data.validations if v.engine})
    return data


def stored_validations(engine: Artifact, store: Store | None) -> list[tuple[ValidationReport, str]]:
    """The validation reports stored for ``engine`` (compile's, one per validation config), with their images; a
    damaged one (files that differ from its manifest, JSON that does not read) is left out, as a cache hit would be."""
    if store is None or not (store.root / STAGE).is_dir():
        return []
    found = []
    for manifest in sorted((store.root / STAGE).glob(f"*/{MANIFEST}")):
        try:
            artifact = Artifact.open(manifest.parent)
            if (artifact.manifest.get("inputs") or [{}])[0].get("digest") != engine.key:
                continue
            if not (problems := artifact.file_problems()):
                report = ValidationReport.from_json(json.loads((artifact.path / REPORT).read_text()))
                found.append((replace(report, images=load_images(artifact.path)), str(artifact.path)))
        except (ArtifactError, OSError, ValueError, KeyError, TypeError) as exc:
            problems = [str(exc)]
        if problems:
            console.print(f"[yellow]![/] report: left out the damaged validation {manifest.parent} ({problems[0]})")
    return found


def _member(component: str, artifact: Artifact) -> Member:
    from ..stages.quantize import precision_label, quantized_from

    lineage = artifact.lineage()
    exported = next((a for a in lineage if a.stage == "export"), None)
    precision = dict(exported.manifest.get("precision", {})) if exported else {}
    if not precision and "io" in artifact.manifest:
        precision = {"graph": artifact.manifest["io"].get("precision", "?")}
    quantized = quantized_from(artifact)
    built = next((a for a in lineage if a.stage == "build-trt"), None)
    return Member(
        component, artifact.stage, artifact.key, str(artifact.path), precision, precision_label(artifact),
        dict(quantized.manifest.get("details", {}).get("kept_high_precision", {})) if quantized else {},
        dict(built.manifest.get("details", {}).get("layer_types", {})) if built else {},
    )  # fmt: skip


def _read_json(path: Path, option: str, shape: type) -> Any:
    """The JSON ``path`` holds, which must be a ``shape`` (a dict, a list) as the command that writes it writes."""
    try:
        read = json.loads(path.read_text())
    except FileNotFoundError:
        raise RequestError(f"{option} {path} does not exist; pass the file the command wrote") from None
    except (OSError, ValueError) as exc:
        raise RequestError(f"{option} {path} cannot be read as JSON ({exc}); pass the file the command wrote") from None
    if not isinstance(read, shape):
        raise RequestError(f"{option} {path} holds a JSON {type(read).__name__}, not the {shape.__name__} the command "
                           "writes; pass the file the command wrote")  # fmt: skip
    return read


def _numbers(report: ValidationReport) -> str:
    """What tells two validations apart (as text: a NaN equals itself there)."""
    return json.dumps(report.to_json(), sort_keys=True)


def _validation(read: dict[str, Any], path: Path) -> ValidationReport:
    try:
        return ValidationReport.from_json(read)
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestError(f"--validation {path} is not a `sdtrt validate --json` report ({type(exc).__name__}: "
                           f"{exc}); pass the file it wrote") from None  # fmt: skip
