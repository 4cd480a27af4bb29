"""Set stage: one artifact naming an engine per component of one model (``unet``, ``text_encoder``, …).

The set holds no files of its own: its manifest lists its members by stage and key, found in the same
store, and its key derives from theirs, so a set of unchanged members is a cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import COMPONENTS, Component
from ..errors import ArtifactError, ConfigError
from ..models import ModelSource, resolve_model
from ..onnx_graph import artifact_spec
from ..spec import FOLDERS
from ..store import Artifact, StageRequest, Store, environment

STAGE = "set"
VERSION = 1


@dataclass(frozen=True)
class EngineSetConfig:
    components: tuple[Component, ...]

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in COMPONENTS]
        if unknown or not self.components:
            raise ConfigError(f"components {unknown or '(none)'} are not among {', '.join(COMPONENTS)}")


def source_model(artifact: Artifact) -> dict[str, Any]:
    """The model an artifact was made from (name, kind, path, digest), as its first stage recorded it."""
    first = (artifact.lineage()[-1].manifest.get("inputs") or [{}])[0]
    if "path" not in first or "digest" not in first:
        raise ArtifactError(
            f"{artifact.path} does not record the model it was made from; pass --model, or rebuild it with sdtrt"
        )
    return first


def recorded_model(engine: Artifact) -> ModelSource:
    """The model ``engine`` was made from, resolved here; ArtifactError when it is not on this machine."""
    recorded = source_model(engine)
    if not Path(recorded["path"]).is_dir():
        raise ArtifactError(
            f"the model {engine.path} was made from ({recorded['path']}) is not on this machine; pass --model"
        )
    return replace(resolve_model(recorded["path"]), name=recorded["name"], kind=recorded["kind"])


def run(config: EngineSetConfig, members: dict[str, Artifact], store: Store, model: ModelSource) -> Artifact:
    """The set of ``members`` (component → artifact), made from ``model``'s weights.

    Each member must come from that model's sub-folder contents: a VAE shared by two models, exported
    once, belongs to both.
    """
    if sorted(members) != sorted(config.components):
        raise ConfigError(f"the set names {list(config.components)} but was given {list(members)}")
    for name, artifact in members.items():
        component = artifact_spec(artifact).component
        if component != name:
            raise ArtifactError(f"{artifact.path} is a {component} artifact, given as the set's {name}")
    sources = {c: source_model(a) for c, a in members.items()}
    foreign = [c for c, s in sorted(sources.items()) if s["digest"] != model.folder_digest(FOLDERS[c])]
    if foreign:
        raise ArtifactError(
            f"the set's members come from different models: {', '.join(foreign)} not from {model.name}'s weights ("
            + ", ".join(f"{c} from {sources[c].get('path')}" for c in foreign)
            + ")"
        )
    inputs = [a.as_input() | {"component": c} for c, a in sorted(members.items())]
    request = StageRequest(STAGE, VERSION, config, inputs, environment())
    artifact, _ = store.produce(request, lambda out_dir: _describe(members, model.describe()))
    return artifact


def _describe(members: dict[str, Artifact], model: dict[str, Any]) -> dict[str, Any]:
    return {
        "primary": "manifest.json",
        "members": {c: {"stage": a.stage, "key": a.key} for c, a in sorted(members.items())},
        "model": {k: model[k] for k in ("name", "kind", "path") if k in model},
        "reproduce": f"sdtrt compile --model {model.get('name')} --components {','.join(sorted(members))}",
    }


def members(engine_set: Artifact) -> dict[str, Artifact]:
    """A set's member artifacts, from the store the set lives in; a missing or changed one is an error."""
    root = Path(engine_set.path).parent.parent
    found = {}
    for component, ref in engine_set.manifest["members"].items():
        folder = root / ref["stage"] / ref["key"][:16]
        if not folder.is_dir():
            raise ArtifactError(
                f"the set {engine_set.path} lists its {component} as {ref['stage']}/{ref['key'][:16]}, which is no "
                f"longer in the store; rebuild the set with `{engine_set.manifest.get('reproduce')}`"
            )
        artifact = Artifact.open(folder)
        if artifact.key != ref["key"]:
            raise ArtifactError(f"{folder} is not the {component} the set {engine_set.path} was made with; rebuild it")
        found[component] = artifact
    return found
