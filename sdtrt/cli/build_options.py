"""What an engine is built for: the options of `build` and `compile` (the target, the shape ranges, the TensorRT build
settings), declared once, and their parsing into a ShapeProfile and a TrtBuildConfig."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from ..core.config import Precision, Range, ShapeProfile, Target, TrtBuildConfig, target_precision_problem
from ..core.errors import ConfigError, RequestError
from ..core.trt_products import gpu_only_problem, parse_compute_capabilities, product, rtx_missing
from ..spec import GraphSpec

TargetOpt = Annotated[
    Target,
    typer.Option(
        help="tensorrt (needs a CUDA GPU), tensorrt-rtx (TensorRT for RTX plans, built here with or without a GPU, "
        "run on RTX GPUs), onnxruntime, or auto: TensorRT where possible."
    ),
]
BatchOpt = Annotated[str | None, typer.Option(help="Images per prompt, N or MIN:OPT:MAX (default 1:1:4; at most 64).")]
HeightOpt = Annotated[str | None, typer.Option(help="Pixel height, N or MIN:OPT:MAX (default: from the model).")]
WidthOpt = Annotated[str | None, typer.Option(help="Pixel width, N or MIN:OPT:MAX (default: from the model).")]
TokensOpt = Annotated[
    str | None,
    typer.Option(
        help="Text tokens a prompt may take, N or MIN:OPT:MAX; a longer prompt is refused, never cut. SD3 / FLUX.1: "
        "T5 tokens, at most 512 (default 32:256:256 for SD3, 32:256:512 for schnell, 32:512:512 for dev); FLUX.2 "
        "[klein]: chat-templated tokens, at most 512 (default 32:512:512); Qwen-Image: the prompt tokens its "
        "transformer reads, at most 1024 (default 1:256:1024; the LLM engine reads its template's 34 more); "
        "Qwen-Image-Edit: text and image tokens, at most 2468 (default 5:1625:2468; the LLM reads 64 more)."
    ),
]


def shape_profile(
    spec: GraphSpec, batch: str | None, height: str | None, width: str | None, tokens: str | None = None
) -> ShapeProfile:
    """--batch/--height/--width (and --tokens) over the spec's default profile, checked against the model's grid
    (in pixels) before anything is exported: a bad range is a usage error (exit 2), not a build failure."""
    default = spec.default_profile()
    if tokens and default.tokens is None:
        raise RequestError("--tokens is the text-token range of T5 and LLM text encoders; this model has no T5 or LLM")
    try:
        profile = dataclasses.replace(  # guidance stays the model's
            default,
            batch=Range.parse(batch, "batch") if batch else default.batch,
            height=Range.parse(height, "height") if height else default.height,
            width=Range.parse(width, "width") if width else default.width,
            tokens=Range.parse(tokens, "tokens") if tokens else default.tokens,
        )
        spec.check_profile(profile)
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
        "only when asked; default: TensorRT-RTX's own set, 8.0 and later; for an FP8 graph 8.9 and later)."
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
