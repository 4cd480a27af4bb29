"""How the ONNX graph is made: the options of `export` and `simplify` (and `compile`, which runs both), declared
once, and their parsing into an ExportConfig and a SimplifyConfig."""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.config import (
    COMPONENTS,
    VISION_ENCODER,
    Component,
    ExportConfig,
    Exporter,
    IONaming,
    Precision,
    SimplifyConfig,
    SimplifyMethod,
    Weights,
    parse_size,
)
from ..core.errors import ConfigError, RequestError

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
    typer.Option(
        help="auto (torch.export-based for every network over 64 MiB, so that its weights stream, and for fp16 text "
        "encoders; TorchScript-based for smaller ones), torchscript or dynamo."
    ),
]
# What --component(s) name: a model's networks (Qwen-Image-Edit's vision tower among them); the step-cache and FreeU
# members come with --caches and --freeu, an IP-Adapter's image encoder with --ip-adapter.
NAMED_COMPONENTS: tuple[Component, ...] = (*COMPONENTS, VISION_ENCODER)
COMPONENTS_HELP = f"{', '.join(COMPONENTS)}, {VISION_ENCODER} (Qwen-Image-Edit's vision tower)"


ComponentOpt = Annotated[
    Component | None, typer.Option(help=f"Which network: {COMPONENTS_HELP} (default: the model's denoiser).")
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
        "the safetensors files: the same graph, memory of one tensor), or auto (stream wherever torch.export's "
        "exporter runs; the manifest says why a network was loaded)."
    ),
]
MethodOpt = Annotated[
    SimplifyMethod,
    typer.Option(
        help="auto: stream for graphs over 64 MiB of weights (or too big for this machine's memory), else onnxsim, "
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
CheckOpt = Annotated[
    bool, typer.Option("--check/--no-check", help="Compare the result with its input on ONNX Runtime.")
]


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
