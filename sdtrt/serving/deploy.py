"""Deploy stage: a Triton Inference Server model repository serving the model's tasks over an engine (set).

::

    REPO/<name>/config.pbtxt     Python backend, instance group (KIND_GPU for TensorRT engines), batching
    REPO/<name>/sdtrt.json       what was deployed: sdtrt version, engine keys, model, profile, batching
    REPO/<name>/report.html      the engines' HTML report (`sdtrt report`): what was validated, for who serves them
    REPO/<name>/1/model.py       imports sdtrt.serving.triton_model, which loads the pipeline with load_pipeline
    REPO/<name>/1/engines/       the engine and, for a set, its members: a store of its own
    REPO/<name>/1/diffusers/     the model's folder (configs, tokenizers, scheduler; the denoiser's weights
                                 (UNet, SD3's / Flux's transformer) stay behind when it runs on an engine)

Files are hard-linked where the store and the repository share a file system, copied otherwise, so
the repository holds everything it serves and can be moved to another machine of the same GPU type.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .. import __version__
from ..core.artifact import Artifact
from ..core.config import ShapeProfile, WeightBudget, as_dict
from ..core.errors import ArtifactError, ConfigError, RequestError
from ..core.families import pipeline_inputs, served_tasks
from ..core.store import Store
from ..pipeline.step_cache import StepCache, engines_problem
from ..sources.models import ModelSource
from ..spec import DENOISERS, FOLDERS

InstanceKind = Literal["auto", "cpu", "gpu"]
DEPLOYMENT = "sdtrt.json"
VERSION_DIR = "1"
ENGINES_DIR = "engines"
MODEL_DIR = "diffusers"
WEIGHTS = (".safetensors", ".bin", ".ckpt", ".pt", ".pth")
GPU_STAGES = ("build-trt", "wrap")
MODEL_PY = '''"""Triton Python-backend model written by `sdtrt deploy triton`: image generation on sdtrt engines."""

from sdtrt.serving.triton_model import TritonPythonModel  # noqa: F401  (Triton looks the class up here)
'''


@dataclass(frozen=True)
class TritonDeployConfig:
    """How Triton serves the engine: model name, instances, batching, and where the instances run."""

    name: str = "stable_diffusion"
    instances: int = 1  # per GPU with KIND_GPU, per server with KIND_CPU
    max_batch: int = 4  # images per execution; at most the engine profile's batch
    max_steps: int = 100  # denoising steps one request may ask for: a bigger one would hold an instance for long
    dynamic_batching: bool = True  # requests sharing size, steps and guidance run as one pipeline call
    max_queue_delay_us: int = 20_000  # how long a request waits for others to batch with
    kind: InstanceKind = "auto"  # auto: KIND_GPU for TensorRT engines, KIND_CPU otherwise
    weight_budget: str | None = None  # WeightBudget text for engines built with weight streaming (default: none)
    cache: str | None = None  # a step cache every request runs with (--cache first-block:0.08); the set needs --caches

    def __post_init__(self) -> None:
        if self.weight_budget is not None:
            WeightBudget.parse(self.weight_budget)  # ConfigError when malformed
        if self.cache is not None:
            StepCache.parse(self.cache)  # ConfigError when malformed
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"model name '{self.name}' may hold only letters, digits, '_' and '-'")
        if self.instances < 1 or self.max_batch < 1 or self.max_steps < 1 or self.max_queue_delay_us < 0:
            raise ConfigError("instances, max batch and max steps must be at least 1, the queue delay at least 0")


@dataclass(frozen=True)
class Deployment:
    """A model in a repository ``deploy_triton`` wrote, as its ``sdtrt.json`` describes it."""

    folder: Path  # REPO/<name>
    record: dict[str, Any]

    @classmethod
    def open(cls, folder: Path) -> Deployment:
        path = folder / DEPLOYMENT
        if not path.is_file():
            raise ArtifactError(f"{folder} has no {DEPLOYMENT}: it was not written by `sdtrt deploy triton`")
        return cls(folder, json.loads(path.read_text()))

    @property
    def engine(self) -> Path:
        return self.folder / VERSION_DIR / self.record["engine"]["path"]

    @property
    def model(self) -> Path:
        return self.folder / VERSION_DIR / MODEL_DIR

    @property
    def profile(self) -> ShapeProfile:
        return ShapeProfile.from_json(self.record["profile"])

    @property
    def max_steps(self) -> int:
        """The bound on a request's steps; repositories written before there was one get the default."""
        return int(self.record["config"].get("max_steps", TritonDeployConfig.max_steps))

    @property
    def cache(self) -> StepCache | None:
        """The step cache the instances run every request with (``sdtrt deploy triton --cache``), if any."""
        text = self.record["config"].get("cache")
        return StepCache.parse(text) if text else None

    @property
    def weight_budget(self) -> str | None:
        """The weight-streaming budget the instances load the engines with (``sdtrt deploy triton
        --weight-streaming-budget``); None keeps every weight on the GPU."""
        budget = self.record["config"].get("weight_budget")
        return str(budget) if budget is not None else None


def deploy_triton(
    engine: Artifact, out: Path, config: TritonDeployConfig = TritonDeployConfig(), model: ModelSource | None = None
) -> Deployment:
    """Write (or replace) model ``config.name`` in the Triton model repository ``out``; returns it.

    ``model`` is needed only where the engine's manifest names no model that exists here.
    """
    from ..pipeline.loading import engine_members
    from ..runtime import check_weight_budget
    from ..stages.engine_set import engine_profile, recorded_model
    from ..tools.report import REPORT_HTML, ReportConfig, write_report_or_warn

    members = engine_members(engine)
    budget = WeightBudget.parse(config.weight_budget) if config.weight_budget is not None else None
    check_weight_budget(members.values(), budget)  # RequestError: no member streams, so it would change nothing
    source = model or recorded_model(engine)
    tasks = served_tasks(source.pipeline_class())  # UnsupportedModelError: a pipeline of no family sdtrt runs
    profile = engine_profile(members)  # every member of a set records compile's one profile
    if profile is None:
        raise ArtifactError(f"{engine.path} records no shape profile; serve an engine built by `sdtrt compile`")
    if config.max_batch > profile.batch.max:
        raise ConfigError(
            f"max batch {config.max_batch} is more than the engine's profile takes ({profile.batch.max} images); "
            f"pass --max-batch {profile.batch.max} or rebuild with `sdtrt compile --batch 1:1:{config.max_batch}`"
        )
    if config.cache is not None and (problem := engines_problem(StepCache.parse(config.cache), members, source)):
        raise RequestError(problem)
    on_gpu = any(a.stage in GPU_STAGES for a in members.values())
    kind = config.kind if config.kind != "auto" else ("gpu" if on_gpu else "cpu")
    if on_gpu and kind == "cpu":
        raise ConfigError("TensorRT engines run on a GPU: deploy them with --kind gpu (or auto)")

    served = [engine, *members.values()]
    served = list({a.path: a for a in served + refill_graphs(served)}.values())  # a lone UNet is its own member
    for artifact in served:  # checked before the deployment it replaces is removed
        artifact.require_intact()
    folder = Path(out) / config.name
    if folder.exists():
        shutil.rmtree(folder)
    version = folder / VERSION_DIR
    for artifact in served:
        _link_tree(artifact.path, version / ENGINES_DIR / artifact.stage / artifact.path.name)
    skip = frozenset(FOLDERS[d.component] for d in DENOISERS if d.component in members)  # engines replace them
    _link_tree(source.path, version / MODEL_DIR, skip_weights_in=skip)
    (version / "model.py").write_text(MODEL_PY)
    (folder / "config.pbtxt").write_text(config_pbtxt(config, kind, wire_inputs(tasks.values())))
    record = {
        "sdtrt_version": __version__,
        "engine": {
            "stage": engine.stage,
            "key": engine.key,
            "path": f"{ENGINES_DIR}/{engine.stage}/{engine.path.name}",
        },
        "members": {c: {"stage": a.stage, "key": a.key} for c, a in sorted(members.items())},
        "model": {"name": source.name, "kind": source.kind, "pipeline": source.pipeline_class()},
        "tasks": tasks,
        "profile": profile.to_json(),
        "kind": kind,
        "config": as_dict(config),
    }
    (folder / DEPLOYMENT).write_text(json.dumps(record, indent=2) + "\n")
    write_report_or_warn(engine, Store(engine.path.parent.parent), ReportConfig(folder / REPORT_HTML))
    return Deployment(folder, record)


def refill_graphs(artifacts: list[Artifact]) -> list[Artifact]:
    """The graphs that weight-stripped plans among ``artifacts`` are refilled from at every load: they are served too
    (the runtime finds them in the plan's own store, which the repository's engines folder is)."""
    from ..runtime.trt_refill import refill_graph

    stripped = [a for a in artifacts if not a.manifest.get("weights", {}).get("in_plan", True)]
    return [Artifact.open(graph.parent) for a in stripped if (graph := refill_graph(a.manifest, a.primary))]


def _link_tree(src: Path, dst: Path, skip_weights_in: frozenset[str] = frozenset()) -> None:
    """``src`` as ``dst``: hard links where possible, else copies; weight files in ``skip_weights_in`` left out."""

    def ignore(folder: str, names: list[str]) -> list[str]:
        inside = Path(folder).resolve().relative_to(src.resolve()).as_posix()
        return [n for n in names if n.endswith(WEIGHTS)] if inside in skip_weights_in else []

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, ignore=ignore, copy_function=link_or_copy, symlinks=False)


# The inputs a row may carry for a task other than text-to-image → Triton datatype and dims (after the batch's):
# pixels as UINT8 height × width × channels, as a PNG decodes (a mask has one channel: white is repainted).
IMAGE_INPUTS = {
    "image": ("TYPE_UINT8", "-1, -1, 3"), "mask_image": ("TYPE_UINT8", "-1, -1, 1"),
    "control_image": ("TYPE_UINT8", "-1, -1, 3"), "image_reference": ("TYPE_UINT8", "-1, -1, 3"),
    "strength": ("TYPE_FP32", "1"),
}  # fmt: skip
# The PIL mode each image is sent and read in.
IMAGE_MODES = {"image": "RGB", "mask_image": "L", "control_image": "RGB", "image_reference": "RGB"}


def wire_inputs(pipelines: Iterable[str]) -> list[str]:
    """The IMAGE_INPUTS that the ``__call__`` of any of ``pipelines`` (diffusers class names) takes, in order."""
    taken = frozenset().union(*(pipeline_inputs(name) for name in pipelines))
    return [name for name in IMAGE_INPUTS if name in taken]


def config_pbtxt(config: TritonDeployConfig, kind: str, images: Iterable[str] = ()) -> str:
    """Triton's model configuration: every input per image (batch dimension first), the ``images`` (IMAGE_INPUTS) the
    served pipelines take, one UINT8 image out. Every input but the prompt is optional."""
    optional = [("negative_prompt", "TYPE_STRING", "1"), ("steps", "TYPE_INT32", "1"), ("guidance", "TYPE_FP32", "1"),
                ("seed", "TYPE_UINT64", "1"), ("height", "TYPE_INT32", "1"), ("width", "TYPE_INT32", "1"),
                *((name, *IMAGE_INPUTS[name]) for name in images)]  # fmt: skip
    inputs = ['  { name: "prompt", data_type: TYPE_STRING, dims: [ 1 ] }'] + [
        f'  {{ name: "{name}", data_type: {dtype}, dims: [ {dims} ], optional: true }}'
        for name, dtype, dims in optional
    ]
    batching = (
        f"dynamic_batching {{ max_queue_delay_microseconds: {config.max_queue_delay_us} }}\n"
        if config.dynamic_batching
        else ""
    )
    return (
        f'name: "{config.name}"\nbackend: "python"\nmax_batch_size: {config.max_batch}\n'
        "input [\n" + ",\n".join(inputs) + "\n]\n"
        'output [\n  { name: "image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ] }\n]\n'
        f"instance_group [ {{ kind: KIND_{kind.upper()}, count: {config.instances} }} ]\n"
        f"{batching}"
    )
