"""Set stage: one artifact naming an engine per component of one model (``unet``, ``text_encoder``, …).

The set holds no files of its own: its manifest lists its members by stage and key, found in the same
store, and its key derives from theirs, so a set of unchanged members is a cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import (
    BUILDABLE,
    FREEU_MEMBER,
    IMAGE_ENCODER,
    TRANSFORMER_PARTS,
    UNET_PARTS,
    Component,
    ShapeProfile,
)
from ..core.errors import ArtifactError, ConfigError, EngineMismatchError
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..graph.onnx_graph import artifact_spec
from ..sources.models import ModelSource, resolve_model
from ..spec import FOLDERS, DenoiserSpec, component_spec, model_components, spec_from_json, split_members
from .ip_adapter import recorded_config

STAGE = "set"
VERSION = 1


@dataclass(frozen=True)
class EngineSetConfig:
    components: tuple[Component, ...]

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in BUILDABLE]
        if unknown or not self.components:
            raise ConfigError(f"components {unknown or '(none)'} are not among {', '.join(BUILDABLE)}")


def source_model(artifact: Artifact) -> dict[str, Any]:
    """The model an artifact was made from (name, kind, path, digest), as its first stage recorded it."""
    first = _first_input(artifact)
    if "path" not in first or "digest" not in first:
        raise ArtifactError(
            f"{artifact.path} does not record the model it was made from; pass --model, or rebuild it with sdtrt"
        )
    return first


def recorded_model(engine: Artifact) -> ModelSource:
    """The model ``engine`` was made from, resolved here; ArtifactError when it is not on this machine. A set names
    its model itself: its members' lineage names whichever model first made each (tiny-controlnet's UNet is tiny's)."""
    described = engine.manifest.get("model") or {}
    recorded = described if "path" in described else source_model(engine)
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
    # An IP-Adapter's image encoder comes from the adapter's folder, not the model's (its key names that folder).
    sources = {c: source_model(a) for c, a in members.items() if c != IMAGE_ENCODER}
    foreign = [c for c, s in sorted(sources.items()) if s["digest"] != model.folder_digest(FOLDERS[c])]
    if foreign:
        raise ArtifactError(
            f"the set's members come from different models: {', '.join(foreign)} not from {model.name}'s weights ("
            + ", ".join(f"{c} from {sources[c].get('path')}" for c in foreign)
            + ")"
        )
    # The model's networks first: a set's lineage (the model it was made from) follows its first input.
    inputs = [a.as_input() | {"component": c} for c, a in sorted(members.items(), key=lambda m: adapter_last(m[0]))]
    request = StageRequest(STAGE, VERSION, config, inputs, environment())
    artifact, _ = store.produce(request, lambda out_dir: _describe(members, model.describe()))
    return artifact


def adapter_last(component: str) -> tuple[bool, str]:
    return component == IMAGE_ENCODER, component


def _describe(members: dict[str, Artifact], model: dict[str, Any]) -> dict[str, Any]:
    # --components names the model's networks: the members beside them come with their options.
    networks = sorted(c for c in members if c not in (*TRANSFORMER_PARTS, *UNET_PARTS, FREEU_MEMBER, IMAGE_ENCODER))
    split = [kind for kind, parts in (("first-block", TRANSFORMER_PARTS), ("deepcache", UNET_PARTS))
             if any(c in members for c in parts)]  # fmt: skip
    caches = f" --caches {','.join(split)}" if split else ""
    caches += " --freeu" if FREEU_MEMBER in members else ""
    denoiser = members.get("unet") or members.get("transformer")
    recorded = recorded_config(denoiser) if denoiser is not None else {}
    if ip_adapter := recorded.get("ip_adapter"):  # as recorded: the set describes itself without the files
        caches += f" --ip-adapter {ip_adapter}"
        if encoder := recorded.get("ip_adapter_image_encoder"):
            caches += f" --ip-adapter-image-encoder {encoder}"
    # The target, said: `auto` picks TensorRT on a GPU machine, so a command without it may build another set.
    target = next((built_for(a) for a in members.values() if built_for(a)), None)
    where = f" --target {target}" if target else ""
    return {
        "primary": "manifest.json",
        "members": {c: {"stage": a.stage, "key": a.key} for c, a in sorted(members.items())},
        "model": {k: model[k] for k in ("name", "kind", "path") if k in model},
        "reproduce": f"sdtrt compile --model {model.get('name')}{where} --components {','.join(networks)}{caches}",
    }


def built_for(member: Artifact) -> str | None:
    """The compile target a member was built for (ONNX Runtime, or the TensorRT product), if its stage says."""
    if member.stage == "build-ort":
        return "onnxruntime"
    product = (member.manifest.get("config") or {}).get("product") if member.stage == "build-trt" else None
    return str(product) if product else None


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


def engine_members(engine: Artifact) -> dict[str, Artifact]:
    """component → artifact: a set's members, or one engine under the component its manifest records
    (a bare .onnx is taken for a UNet)."""
    if engine.stage == "set":
        return members(engine)
    io = engine.manifest.get("io")
    return {spec_from_json(io).component if io else "unet": engine}


def engine_profile(members: dict[str, Artifact]) -> ShapeProfile | None:
    """The user shape profile the engines were built for, if recorded: compile's one, the denoiser's (the others share
    it, or derive theirs from it: Qwen-Image's LLM, spec.member_profile)."""
    denoiser_first = sorted(members, key=lambda component: component not in ("unet", "transformer"))
    return next((ShapeProfile.from_json(p) for c in denoiser_first if (p := members[c].manifest.get("profile"))), None)


def check_pairing(members: dict[str, Artifact], model: ModelSource) -> None:
    """EngineMismatchError, in one line, unless every member was made from ``model``'s network.

    Each member's graph IO must be what ``model`` needs (family conditioning, channels, widths), and
    the content hash of the sub-folder it was exported from (its export manifest records it) must be
    the model's: the same shapes with other weights fail parity for no fault of the engine. An engine
    that records neither (a bare .onnx) is checked on its IO alone, and only where it has a manifest.
    """
    for component, member in sorted(members.items()):
        io = member.manifest.get("io")
        if not io or component == IMAGE_ENCODER:  # the IP-Adapter's, paired with the UNet that holds the adapter
            continue
        spec, folder, recorded = spec_from_json(io), FOLDERS[component], _first_input(member)
        if component not in model_components(model) + split_members(model):
            problem: str | None = f"{model.name} has no {folder}/"
        else:
            wanted = component_spec(model, spec.component, spec.precision, spec.io_naming)
            if isinstance(spec, DenoiserSpec) and isinstance(wanted, DenoiserSpec):  # its IP-Adapter is its own
                wanted = replace(
                    wanted, image_embeds_dim=spec.image_embeds_dim, ip_layers=spec.ip_layers,
                    ip_adapter_digest=spec.ip_adapter_digest,
                )  # fmt: skip
            problem = _io_difference(spec.to_json(), wanted.to_json())
        if not problem and "digest" in recorded and recorded["digest"] != model.folder_digest(folder):
            problem = f"its weights differ from the model's {folder}/ (content hash)"
        if problem:
            made_from = recorded.get("name") or recorded.get("path") or "another model"
            family = next((a.manifest["family"] for a in member.lineage() if "family" in a.manifest), None)
            families = f" ({family} vs {model.family()})" if family and family != model.family() else ""
            raise EngineMismatchError(
                f"the {spec.label} engine {member.path} was made from {made_from}, not {model.name}{families}: "
                f"{problem}; pass the model it was made from as --model (or omit --model), or compile one for "
                f"{model.name}"
            )


def _first_input(artifact: Artifact) -> dict[str, Any]:
    """What the artifact's first stage was made from (a model: name, path, digest), or {} when not recorded."""
    first = (artifact.lineage()[-1].manifest.get("inputs") or [{}])[0]
    return {} if first.get("kind") == "artifact" else dict(first)  # a model records its source's kind


def _io_difference(have: dict[str, Any], want: dict[str, Any]) -> str | None:
    """The first graph tensor that differs between two specs' JSON, said for people; None when the IO agree."""
    tensors = {t["name"]: t for t in have["inputs"] + have["outputs"]}
    for t in want["inputs"] + want["outputs"]:
        if t["name"] not in tensors:
            return f"the model needs an input '{t['name']}' the engine lacks"
        if (got := tensors.pop(t["name"])) != t:
            engine, wanted = f"{got['dtype']} {got['shape']}", f"{t['dtype']} {t['shape']}"
            return f"'{t['name']}' is {engine} in the engine, {wanted} for the model"
    if tensors:
        return f"the engine takes '{next(iter(tensors))}', which the model does not"
    return None
