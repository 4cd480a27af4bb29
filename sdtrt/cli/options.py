"""Options shared by several commands, declared once (like Polygraphy's argument groups)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core.artifact import Artifact
from ..core.config import (
    COMPONENTS,
    Component,
    ExportConfig,
    Exporter,
    IONaming,
    Precision,
    Range,
    ShapeProfile,
    SimplifyConfig,
    SimplifyMethod,
    Target,
    TrtBuildConfig,
    WeightBudget,
    Weights,
    parse_size,
    target_precision_problem,
)
from ..core.errors import ArtifactNotFoundError, ConfigError, RequestError, StoreError
from ..core.store import Store
from ..core.trt_products import gpu_only_problem, parse_compute_capabilities, product, rtx_missing
from ..sources.models import ModelSource
from ..sources.presets import PRESETS
from ..spec import GraphSpec

if TYPE_CHECKING:
    from ..pipeline.request import GenerateRequest

ModelOpt = Annotated[
    str,
    typer.Option("--model", "-m", help=f"Preset ({', '.join(PRESETS)}), local diffusers folder, or hub id."),
]
# Commands that take an engine: the model defaults to the one the engine was made from.
EngineModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Preset, local diffusers folder, or hub id (default: the model the engine was made from; "
        "tiny without --engine).",
    ),
]
EnginesOpt = Annotated[
    Path | None,
    typer.Option("--engines", envvar="SDTRT_ENGINES", help="Artifact store directory (default: ./engines)."),
]
ENGINE_HELP = "Engine artifact: a directory or file a stage printed, or a key from `sdtrt cache ls` (KEY or STAGE/KEY)"
EngineOpt = Annotated[str | None, typer.Option(help=f"{ENGINE_HELP}; omit for plain PyTorch.")]
HeightPxOpt = Annotated[int | None, typer.Option(help="Image height in pixels (default: the model's).")]
WidthPxOpt = Annotated[int | None, typer.Option(help="Image width in pixels (default: the model's).")]
# What to generate (`generate`, `client`).
PromptOpt = Annotated[str, typer.Option(help="What to draw.")]
NegativePromptOpt = Annotated[str | None, typer.Option(help="What to steer away from.")]
StepsOpt = Annotated[int, typer.Option(min=1, help="Denoising steps.")]
GuidanceOpt = Annotated[
    float | None,
    # No square brackets: rich reads them as markup and drops them from --help.
    typer.Option(help="Guidance scale (default: 7.5; FLUX.1-dev's distilled guidance 3.5; FLUX.1-schnell takes none)."),
]
LORA_METAVAR = "<FILE[:SCALE]>"
SeedOpt = Annotated[int, typer.Option(help="Random seed, 0..2^64-1; the same seed gives the same image.")]


PrecisionOpt = Annotated[
    Precision,
    typer.Option(
        help="Graph precision. bf16 is for --target tensorrt (strongly typed; Resize, Sin and Cos kept fp32): "
        "ONNX Runtime on a CPU runs no bf16 graph (no bfloat16 Conv, Gemm or Add kernels), so onnxruntime "
        "refuses it and bf16 graphs are validated on TensorRT only."
    ),
]
ExporterOpt = Annotated[
    Exporter,
    typer.Option(help="auto (TorchScript-based; torch.export-based for fp16 text encoders), torchscript or dynamo."),
]
ComponentOpt = Annotated[
    Component | None, typer.Option(help=f"Which network: {', '.join(COMPONENTS)} (default: the model's denoiser).")
]
OpsetOpt = Annotated[int, typer.Option(help="ONNX opset.")]
IONamingOpt = Annotated[
    IONaming,
    typer.Option(help="named (sample, timestep, …) or indexed (input_0…, output_0, for torchtrtc --embed-engine)."),
]
WeightsOpt = Annotated[
    Weights,
    typer.Option(
        help="load (the network whole, then traced), stream (traced without weights; the initializers streamed from "
        "the safetensors files: the same graph, memory of one tensor), or auto (stream over 2 GB of weights with "
        "torch.export's exporter)."
    ),
]
MethodOpt = Annotated[
    SimplifyMethod,
    typer.Option(
        help="auto: stream for graphs over 2 GB of weights (or too big for this machine's memory), else onnxsim, "
        "else constant folding; stream: clean up without loading the weights (the kernel copies their file)."
    ),
]
MemoryBudgetOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SDTRT_MEMORY_BUDGET",
        help="Memory the step may plan with (8GiB, 8GB; default: this machine's): over it, simplify streams the "
        "weights and skips its ONNX Runtime check (~4x the weights), and validate lists the cases that would not fit "
        "instead of running them; each says so.",
    ),
]
TargetOpt = Annotated[
    Target,
    typer.Option(
        help="tensorrt (needs a CUDA GPU), tensorrt-rtx (TensorRT for RTX plans, built here with or without a GPU, "
        "run on RTX GPUs), onnxruntime, or auto: TensorRT where possible."
    ),
]
CheckOpt = Annotated[
    bool, typer.Option("--check/--no-check", help="Compare the result with its input on ONNX Runtime.")
]
BatchOpt = Annotated[
    str | None, typer.Option(help="Images per prompt, N or MIN:OPT:MAX (default 1:1:4; at most 64: config.MAX_BATCH).")
]
HeightOpt = Annotated[str | None, typer.Option(help="Pixel height, N or MIN:OPT:MAX (default: from the model).")]
WidthOpt = Annotated[str | None, typer.Option(help="Pixel width, N or MIN:OPT:MAX (default: from the model).")]
TokensOpt = Annotated[
    str | None,
    typer.Option(
        help="SD3 / Flux: T5 tokens a prompt may take, N or MIN:OPT:MAX, at most 512 (default 32:256:256 for SD3, "
        "32:256:512 for schnell, 32:512:512 for dev); a longer prompt is refused, never cut."
    ),
]


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


def open_store(engines: Path | None, cached_ok: bool = False) -> Store:
    """The --engines store, refused up front when it cannot take a new artifact; with ``cached_ok`` a
    read-only store is accepted: complete cache hits write nothing, and a miss fails before its stage runs."""
    store = Store(engines)
    try:
        store.ensure_writable()
    except StoreError:
        if not (cached_ok and store.root.is_dir()):
            raise
    return store


def find_engine(engine: str, engines: Path | None, option: str | None = "--engine") -> Artifact:
    """--engine (or the engine argument, ``option`` None) as a path or a key in the --engines store; one that names
    no artifact is a usage error (exit 2), one that names a broken artifact is not."""
    try:
        return Store(engines).find(engine)
    except ArtifactNotFoundError as exc:
        raise RequestError(f"{option} {exc}" if option else str(exc)) from None


def check_export_options(exporter: Exporter, weights: Weights) -> None:
    """--exporter with --weights, refused (exit 2) before the model is resolved (a preset may be built)."""
    try:
        ExportConfig(exporter=exporter, weights=weights)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def export_config(
    precision: Precision,
    exporter: Exporter,
    opset: int,
    io_naming: IONaming,
    component: Component,
    weights: Weights = "auto",
) -> ExportConfig:
    return ExportConfig(
        precision=precision, opset=opset, exporter=exporter, io_naming=io_naming, component=component, weights=weights
    )


def memory_budget(text: str | None) -> int | None:
    """--memory-budget in bytes (a size, checked before anything loads: exit 2 when malformed)."""
    try:
        budget = parse_size(text) if text is not None else None
        if budget is not None and budget <= 0:
            raise ValueError(f"memory budget {text} is not a positive size")
        return budget
    except ValueError as exc:
        raise RequestError(f"--memory-budget: {exc}; give a size such as 8GiB or 8GB") from None


def simplify_config(method: SimplifyMethod, check: bool, budget: str | None = None) -> SimplifyConfig:
    """--method, --check and --memory-budget."""
    return SimplifyConfig(method=method, check=check, memory_budget=memory_budget(budget))


def shape_profile(
    spec: GraphSpec, batch: str | None, height: str | None, width: str | None, tokens: str | None = None
) -> ShapeProfile:
    """--batch/--height/--width (and --tokens) over the spec's default profile, checked against the model's grid
    (in pixels) before anything is exported: a bad range is a usage error (exit 2), not a build failure."""
    default = spec.default_profile()
    if tokens and default.tokens is None:
        raise RequestError("--tokens is the T5 token range of SD3 and Flux engines; this model has no T5")
    try:
        profile = dataclasses.replace(  # guidance stays the model's
            default,
            batch=Range.parse(batch, "batch") if batch else default.batch,
            height=Range.parse(height, "height") if height else default.height,
            width=Range.parse(width, "width") if width else default.width,
            tokens=Range.parse(tokens, "tokens") if tokens else default.tokens,
        )
        profile.check(spec.pixel_multiple)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc
    return profile


# TensorRT build settings (used by `build` and `compile`).
StaticOpt = Annotated[bool, typer.Option("--static", help="TensorRT: build for the optimum shape only (CUDA graphs).")]
WorkspaceOpt = Annotated[float | None, typer.Option(help="TensorRT: workspace limit in GB (default: TensorRT's).")]
OptLevelOpt = Annotated[
    int | None,
    typer.Option(
        min=0, max=5, help="TensorRT builder optimization level (default: 3, TensorRT's; 4 for INT8/FP8 graphs "
        "except Flux's, as NVIDIA's demo builds them)."
    ),
]  # fmt: skip
WeightStreamingOpt = Annotated[
    bool,
    typer.Option(
        "--weight-streaming",
        help="TensorRT: the engine can stream weights from host memory; --weight-streaming-budget at run time "
        "sets how much stays on the GPU.",
    ),
]
StripWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--strip-weights",
        help="TensorRT: a plan without its weights (megabytes, not the graph's gigabytes), refilled from its ONNX "
        "graph in the store at every load; with --refittable all weights are stripped and LoRAs still refit.",
    ),
]
WeightBudgetOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SDTRT_WEIGHT_STREAMING_BUDGET",
        help="TensorRT engines built with --weight-streaming: GPU memory for the weights of each streaming engine "
        "(not shared across a set): auto (TensorRT's, from free memory), a percentage of its streamable weights "
        "(50%) or a size (8GiB, each); 0 streams the most (default: all on the GPU).",
    ),
]
TimingCacheOpt = Annotated[
    Path | None, typer.Option(help="TensorRT: timing cache file, read if present and updated after the build.")
]

RefittableOpt = Annotated[
    bool, typer.Option("--refittable", help="TensorRT: weights refittable in place, so LoRAs need no rebuild.")
]

ComputeCapabilityOpt = Annotated[
    str | None,
    typer.Option(
        help="TensorRT-RTX: the GPUs' compute capabilities the plan runs on, comma-separated (8.6,8.9,12.0; 7.5 "
        "only when asked; default: TensorRT-RTX's own set, 8.0 and later)."
    ),
]

TF32Opt = Annotated[
    bool | None,
    typer.Option(
        "--tf32/--no-tf32",
        help=(
            "TensorRT: fp32 layers may compute in TF32 (default: off for --precision fp32 graphs, on for 16-bit "
            "ones and for members compile makes fp32 for range: upcast VAEs, T5)."
        ),
    ),
]


def check_target_precision(target: Target, precision: Precision) -> None:
    """A precision the target cannot build is a usage error (exit 2), before any model loads."""
    from ..tools.compile import resolve_target

    if problem := target_precision_problem(resolve_target(target)[0], precision):
        raise RequestError(problem)


def weight_budget(text: str | None) -> WeightBudget | None:
    """--weight-streaming-budget, parsed before anything loads (exit 2 when malformed); load_pipeline and validate
    check that an engine takes it before loading a network."""
    try:
        return WeightBudget.parse(text) if text is not None else None
    except ConfigError as exc:
        raise RequestError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class TrtOptions:
    """The TensorRT build options `build` and `compile` share; ``with_trt_options`` declares them on a command."""

    static: bool = False
    workspace_gb: float | None = None
    optimization_level: int | None = None
    timing_cache: Path | None = None
    refittable: bool = False
    tf32: bool | None = None
    weight_streaming: bool = False
    strip_weights: bool = False
    compute_capability: str | None = None

    def config(self, profile: ShapeProfile, target: Target) -> TrtBuildConfig:
        """The build config for ``target``'s TensorRT product (the datacenter one unless tensorrt-rtx)."""
        return TrtBuildConfig(
            profiles=(profile,),
            static_shapes=self.static,
            workspace_gb=self.workspace_gb,
            optimization_level=self.optimization_level,
            timing_cache=str(self.timing_cache.resolve()) if self.timing_cache else None,
            refittable=self.refittable,
            tf32=self.tf32,
            weight_streaming=self.weight_streaming,
            strip_weights=self.strip_weights,
            product="tensorrt-rtx" if target == "tensorrt-rtx" else "tensorrt",
            compute_capabilities=parse_compute_capabilities(self.compute_capability),
        )

    def check(self, target: Target) -> None:
        """Refuse (exit 2, before any export) what ``target`` cannot build: tensorrt-rtx without TensorRT-RTX, an
        unknown compute capability, a setting only the other TensorRT product has, one that needs a GPU here."""
        if target == "tensorrt-rtx" and (missing := rtx_missing()):
            raise RequestError(f"--target tensorrt-rtx: {missing}")
        try:
            config = self.config(ShapeProfile(), target)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        if problem := gpu_only_problem(product(config.product), config.refittable, config.strip_weights):
            raise RequestError(problem)


_TRT_OPTION_TYPES = {
    "static": StaticOpt,
    "workspace_gb": WorkspaceOpt,
    "optimization_level": OptLevelOpt,
    "timing_cache": TimingCacheOpt,
    "refittable": RefittableOpt,
    "tf32": TF32Opt,
    "weight_streaming": WeightStreamingOpt,
    "strip_weights": StripWeightsOpt,
    "compute_capability": ComputeCapabilityOpt,
}


def with_trt_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with the TensorRT build options as its parameters (before --engines), handed to it as one
    ``trt: TrtOptions`` argument. Typer reads a command's parameters from its signature, so the wrapper shows it
    one that lists each option (typer/utils.py, get_params_from_function)."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "trt"]
    at = next(i for i, p in enumerate(own) if p.name == "engines")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    added = [
        inspect.Parameter(f.name, kind, default=f.default, annotation=_TRT_OPTION_TYPES[f.name])
        for f in dataclasses.fields(TrtOptions)
    ]
    parameters = [*own[:at], *added, *own[at:]]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        trt = TrtOptions(**{name: kwargs.pop(name) for name in _TRT_OPTION_TYPES})
        command(**kwargs, trt=trt)

    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
    return wrapper


def model_for(model: str | None, engine: Artifact | None) -> ModelSource:
    """``--model`` when given (checked against ``engine``: exit 2 when the engine was made from another model),
    else the model ``engine`` was made from, else the tiny preset."""
    from ..sources.models import resolve_model
    from ..stages.engine_set import check_pairing, engine_members, recorded_model

    if model:
        source = resolve_model(model)
        if engine is not None:
            check_pairing(engine_members(engine), source)
        return source
    return recorded_model(engine) if engine is not None else resolve_model("tiny")


def check_engine_size(artifact: Artifact | None, request: GenerateRequest) -> None:
    """RequestError (exit 2) before anything loads when a sized request is outside the engines' profile."""
    if artifact is None:
        return
    from ..stages.engine_set import engine_members, engine_profile

    profile = engine_profile(engine_members(artifact))
    if profile is None or not (request.height and request.width):
        return
    if problem := profile.size_problem(request.height, request.width):
        raise RequestError(problem)


def lora_options(values: list[str] | None) -> list[tuple[str, float]]:
    """``--lora FILE[:SCALE]`` options, checked before anything loads: a bad scale or a missing file is a
    usage error (exit 2); what is inside the file is checked where it is read."""
    from ..core.errors import LoraError
    from ..lora.files import parse_lora_option

    loras = []
    for value in values or []:
        try:
            path, scale = parse_lora_option(value)
        except LoraError as exc:
            raise RequestError(str(exc)) from None
        if not Path(path).exists():
            raise RequestError(f"--lora {value}: LoRA file {path} does not exist")
        loras.append((path, scale))
    return loras
