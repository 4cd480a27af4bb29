"""Quantize stage: the denoiser → INT8 or FP8 Q/DQ ONNX graphs with NVIDIA ModelOpt.

The denoiser (a UNet, or SD3's / Flux's transformer) is quantized by ``mtq.quantize(network, config, forward_loop)``
with ModelOpt's diffusers presets (``configs/ptq/presets/diffusers/int8|fp8``; SmoothQuant from
``mtq.INT8_SMOOTHQUANT_CFG``), calibrated by replaying the inputs it saw while the fp32 pipeline denoised the
calibration prompts (stages/calibration.py). The layers NVIDIA keeps in high precision are never quantized (per
denoiser kind: ``DenoiserQuantization``), and the level picks the Linear layers (NVIDIA's ``quantize_lvl`` in
TensorRT demo/Diffusion and ModelOpt's examples/diffusers/quantization/utils.py, one rule for UNets and
transformers).

Two graphs from one calibration, because one cannot do both jobs (the manifest's ``graphs`` says which file is which,
``precision.graph`` each one's precision outside its Q/DQ pairs, and why):

- ``tensorrt``: 16 bits outside the Q/DQ pairs, as NVIDIA exports quantized denoisers (``tensorrt_precision``): a
  strongly typed build runs every op in its graph's type, so an fp32 graph would run attention, norms and the layers
  kept in high precision in fp32, slower than sdtrt's own fp16 engine. Exported as ModelOpt's diffusers example
  exports it (onnx_utils/export.py ``modelopt_export_sd``: TorchScript exporter, opset 20; for FP8
  ``generate_fp8_scales`` then ``convert_zp_fp8``), its ``trt::`` FP8 ops kept for TensorRT.
- ``onnxruntime`` (the artifact's primary): fp32 outside the Q/DQ pairs, which ONNX Runtime's CPU provider runs well,
  with every ``trt::TRT_FP8QuantizeLinear`` / ``TRT_FP8DequantizeLinear`` rewritten to standard
  QuantizeLinear/DequantizeLinear (float8e4m3fn zero point, ``saturate=1``): CPU validation checks the scales TensorRT
  will use (the same amax; the TensorRT graph holds them rounded to its 16-bit type).

Calibration runs in fp32 on the CPU. The fp32 graph is exported first; the calibrated module is then cast to 16 bits
in place (``as_16_bit``) and exported again: each graph is written once, the weights never held twice. At level 4 both
graphs are fp16 (ModelOpt exports FP8 attention only from a 16-bit module): one export serves both roles.

Here: the stage (its key, its manifest) and what later stages ask of its artifacts; the layer selection and ModelOpt's
config are quantize_layers.py's, the two graphs' export quantize_export.py's, the Q/DQ rewrites qdq.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.artifact import Artifact
from ..core.config import QUANT_LEVELS, Component, ExportConfig, Precision, QuantizeConfig
from ..core.errors import ArtifactError, ConfigError
from ..core.progress import step
from ..core.stage_request import StageRequest, digest, environment
from ..core.store import Store
from ..graph import onnx_graph
from ..sources.models import ModelSource
from ..spec import GraphSpec, denoiser_component, folder_architecture, spec_class
from . import calibration, export
from .quantize_export import OPSET, ROLE_NAMES, write_graphs
from .quantize_layers import (
    LayerPlan,
    _quiet,
    attention_quantized,
    denoiser_quantization,
    modelopt,
    modelopt_config,
    plan_layers,
)
from .quantize_members import calibration_result, holds_qdq, member_manifest, same_calibration

if TYPE_CHECKING:
    import torch

STAGE = "quantize"
VERSION = 2  # 2: the TensorRT graph is 16-bit outside its Q/DQ pairs (it was the fp32 one)


def run(config: QuantizeConfig, model: ModelSource, store: Store) -> Artifact:
    """The quantized denoiser's graphs for ``model`` (a cache hit for the same model, config and calibration set)."""
    return run_members(config, model, store)[denoiser_component(model)]


def run_members(
    config: QuantizeConfig, model: ModelSource, store: Store, parts: tuple[Component, ...] = ()
) -> dict[str, Artifact]:
    """The quantized denoiser's artifact and, for step caches, one per split member ``parts`` (the transformer's
    four, DeepCache's two), cut from the same calibrated network: their Q/DQ scales are the denoiser's, so the
    chained members compute what the quantized whole computes. One calibration serves the members missing from the
    store, and only they are exported (into a scratch folder, then moved into each artifact). A stored denoiser whose
    calibration the new members' does not reproduce is refused (``same_calibration``)."""
    check_model(config, model)
    denoiser = denoiser_component(model)
    requests = {c: request_for(config, model, c) for c in (denoiser, *parts)}
    written: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as held:
        if any(store.stored(r) is None for r in requests.values()):
            # One run at a time makes a denoiser's members: two would calibrate twice, and might mix the results.
            held.enter_context(store.lock(f"{requests[denoiser].key[:16]}.members", f"quantize {model.name}'s members"))
            if missing := tuple(c for c, r in requests.items() if store.stored(r) is None):
                written = _quantize(config, model, missing, held.enter_context(store.scratch(STAGE)))
                if denoiser not in missing:
                    same_calibration(store.stored(requests[denoiser]), written, missing[0])
        return {
            c: store.produce(r, functools.partial(member_manifest, model, c, written.get(c, {})))[0]
            for c, r in requests.items()
        }


def request_for(config: QuantizeConfig, model: ModelSource, component: Component | None = None) -> StageRequest:
    """What ``run`` asks the store for: keyed by the model's denoiser, the graph contract (the denoiser's, or a split
    member's), the config (precision, level, algorithm, layers kept) and a hash of the calibration set."""
    spec = denoiser_graph_spec(model, config, component)
    return StageRequest(
        stage=STAGE,
        version=VERSION,
        config=config,
        inputs=[
            *export.network_inputs(model, spec),
            {"kind": "calibration", "digest": digest(config.calibration_set())},
        ],
        environment=environment("torch", "diffusers", "onnx", "nvidia-modelopt"),
    )


def denoiser_graph_spec(
    model: ModelSource, config: QuantizeConfig = QuantizeConfig(), component: Component | None = None
) -> GraphSpec:
    """The contract of the artifact's primary graph, ONNX Runtime's (``graph_specs``)."""
    return graph_specs(model, config, component)["onnxruntime"]


def graph_specs(
    model: ModelSource, config: QuantizeConfig = QuantizeConfig(), component: Component | None = None
) -> dict[str, GraphSpec]:
    """Each graph's contract, by role (``tensorrt``, ``onnxruntime``): the denoiser's (or its split member
    ``component``'s), in that graph's precision outside its Q/DQ pairs."""
    precisions: dict[str, Precision] = {
        "tensorrt": tensorrt_precision(model),
        # ModelOpt exports FP8 attention only from a 16-bit module (as_16_bit): level 4's graph is fp16 for both.
        "onnxruntime": "fp16" if attention_quantized(config) else "fp32",
    }
    component = component or denoiser_component(model)
    return {
        role: export.spec_for(model, ExportConfig(precision=precision, component=component))
        for role, precision in precisions.items()
    }


def tensorrt_precision(model: ModelSource) -> Precision:
    """The TensorRT graph's precision outside its Q/DQ pairs, as NVIDIA exports each family's quantized denoiser.

    fp16 for UNets and SD3: ModelOpt's examples/diffusers/quantization/quantize.py loads the model and sets the Q/DQ
    type in Half by default (``ModelConfig.model_dtype``, ``trt_high_precision_dtype``), and onnx_utils/export.py traces
    dummy inputs of the model's dtype; TensorRT demo/Diffusion quantizes SD 1.x/SDXL/SD3.5 with
    ``SD_FP8_FP16_DEFAULT_CONFIG`` (demo_diffusion/pipeline/diffusion_pipeline.py). bf16 for Flux: demo/Diffusion
    turns bf16 on for any quantized Flux (flux_pipeline.py: ``self.bf16 = True if int8 or fp8 or fp4``) and sets its
    Q/DQ type to BFloat16 (``set_quant_precision``); ModelOpt's README builds Flux FP8 with ``trtexec --bf16``.
    A strongly typed network needs a 16-bit scale to be of its input's type (NvInfer.h IQuantizeLayer: "if the scale
    data type is DataType::kHALF or DataType::kBF16, it must match the input data type"): ``as_16_bit`` sets both."""
    return "bf16" if model.family().startswith("flux") else "fp16"


def check_model(config: QuantizeConfig, model: ModelSource) -> None:
    """ConfigError, from the model's configs alone (nothing loaded), when this model cannot be quantized so: a
    denoiser whose class overflows fp16 (Z-Image's) where its quantized graph would be fp16 outside the Q/DQ pairs."""
    denoiser = denoiser_component(model)
    fp16_problem = spec_class(denoiser, folder_architecture(model, denoiser)).fp16_problem
    if fp16_problem and tensorrt_precision(model) == "fp16":
        raise ConfigError(
            f"a quantized {model.family()} {denoiser} would keep its other layers in fp16, and {fp16_problem}; "
            "build it unquantized (--precision fp16 builds it in bf16)"
        )
    kind = denoiser_quantization(model)
    if why := kind.refused.get(config.level):
        offered = [level for level in QUANT_LEVELS if level not in kind.refused and level < 4]
        raise ConfigError(
            f"level {config.level:g} quantizes {QUANT_LEVELS[config.level]}, and {why}; "
            f"use --level {', '.join(f'{level:g}' for level in offered)}"
        )
    if config.level == 4.0 and (odd := [size for size in kind.head_sizes(model.denoiser_config()) if size % 16]):
        raise ConfigError(
            f"level 4 quantizes attention in FP8, which needs head sizes that are multiples of 16, and "
            f"'{model.name}' has heads of {', '.join(map(str, sorted(set(odd))))}; use --level 3"
        )


@dataclass
class QuantizedDenoiser:
    """ModelOpt's fake-quantized PyTorch denoiser, and how it was made."""

    network: torch.nn.Module
    plan: LayerPlan
    calibration_calls: int
    timings: dict[str, float]


def quantized_denoiser(config: QuantizeConfig, model: ModelSource) -> QuantizedDenoiser:
    """The model's denoiser quantized with ModelOpt (fake quantization, in PyTorch), calibrated on its pipeline."""
    check_model(config, model)
    mtq = modelopt()
    timings = {}
    started = time.perf_counter()
    with step(f"Loading the fp32 pipeline of {model.name}"):
        pipe = calibration.load_reference_pipeline(model)
        network = calibration.pipeline_denoiser(pipe, model).eval()
        plan = plan_layers(network, config, denoiser_quantization(model))
    with step(
        f"Recording calibration inputs ({len(config.calibration_prompts)} prompts × {config.calibration_steps} steps)"
    ):
        recorded = calibration.record(pipe, network, config)
    del pipe
    timings["calibration_inputs_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    quant = modelopt_config(config, plan)
    with step(f"Quantizing with ModelOpt ({config.precision}, level {config.level:g}, {config.algorithm})"), _quiet():
        mtq.quantize(network, quant, recorded.replay)
    timings["quantize_s"] = round(time.perf_counter() - started, 3)
    return QuantizedDenoiser(network.eval(), plan, len(recorded.calls), timings)


def _quantize(
    config: QuantizeConfig, model: ModelSource, members: tuple[Component, ...], folder: Path
) -> dict[str, dict[str, Any]]:
    """Calibrate once and write these members' graphs into ``folder``: each member's files by role, contracts, and
    the manifest fields it shares with the others."""
    quantized = quantized_denoiser(config, model)
    result = calibration_result(quantized.network)  # before the export changes the quantizers (FP8, 16 bits)
    timings = dict(quantized.timings)
    specs: dict[str, dict[str, GraphSpec]] = {c: graph_specs(model, config, c) for c in members}
    graphs = write_graphs(quantized.network, config, specs, folder, timings)
    plan = quantized.plan
    shared = {
        "family": model.family(),
        "precision": {"quantized": config.precision},
        "graphs_why": {
            "tensorrt": "as NVIDIA exports it (ModelOpt's diffusers example, TensorRT's demo/Diffusion): 16 bits "
            "outside the Q/DQ pairs, trt:: FP8 ops kept (TensorRT reads them)",
            "onnxruntime": "standard ONNX Q/DQ only (trt:: FP8 ops rewritten), which ONNX Runtime's CPU provider runs",
        },
        "timings": timings,
        "details": {
            "level": config.level,
            "level_quantizes": QUANT_LEVELS[config.level],
            "algorithm": config.algorithm,
            "quantized_layers": list(plan.quantized),
            "kept_high_precision": plan.kept,
            "calibration": config.calibration_set()
            | {"denoiser_calls": quantized.calibration_calls, "digest": digest(config.calibration_set())},
            "calibration_result": result,
            "opset": OPSET,
            # Not streamed (export's default): calibration runs the network, so its weights are loaded.
            "weights": "load",
            "weights_reason": "ModelOpt calibrates the loaded network on real denoising steps before its export",
        },
        "reproduce": (
            f"sdtrt quantize --model {model.name} --precision {config.precision} --level {config.level:g} "
            f"--calibration-steps {config.calibration_steps}"
        ),
    }
    return {
        component: {"graphs": graphs[component], "specs": specs[component], "shared": shared, "folder": folder}
        for component in members
    }


def tensorrt_graph(artifact: Artifact) -> Path:
    """The graph TensorRT must build for an artifact made from a quantize artifact (itself, or a later stage
    whose lineage holds one); for other artifacts, their primary graph. The hook for `build` on TensorRT."""
    if made_from := quantized_from(artifact):
        return made_from.path / made_from.manifest["graphs"]["tensorrt"]
    if artifact.primary.suffix != ".onnx":
        raise ArtifactError(f"{artifact.path} holds no ONNX graph for TensorRT")
    return artifact.primary


def tensorrt_spec(artifact: Artifact) -> GraphSpec:
    """The contract of ``tensorrt_graph(artifact)``: a quantize artifact's TensorRT graph has its own precision outside
    the Q/DQ pairs (16 bits where ONNX Runtime's graph is fp32); any other graph is the artifact's own."""
    spec = onnx_graph.artifact_spec(artifact)
    made_from = quantized_from(artifact)
    return spec if made_from is None else dataclasses.replace(spec, precision=graph_precisions(made_from)["tensorrt"])


def graph_precisions(quantized: Artifact) -> dict[str, Precision]:
    """A quantize artifact's graph precision outside the Q/DQ pairs, by role (VERSION 1 wrote one value for both)."""
    graph = quantized.manifest["precision"]["graph"]
    return dict(graph) if isinstance(graph, dict) else {"tensorrt": graph, "onnxruntime": graph}


def quantization(artifact: Artifact) -> str | None:
    """The 8-bit format ("int8", "fp8") of the Q/DQ graph an artifact is or was made from (a quantize artifact in
    its lineage), or None: none there, or a split member that holds no Q/DQ (``holds_qdq``)."""
    made_from = quantized_from(artifact)
    return None if made_from is None or not holds_qdq(made_from) else str(made_from.manifest["config"]["precision"])


def precision_label(artifact: Artifact) -> str | None:
    """How a report names the precision of an artifact made from a quantize artifact: its format, level and the graph
    it runs, "int8 level 2.5 (ONNX Runtime graph, fp32 outside Q/DQ)" (a TensorRT engine runs the TensorRT graph,
    anything else ONNX Runtime's); None for any other artifact."""
    made_from = quantized_from(artifact)
    if made_from is None or not holds_qdq(made_from):
        return None
    role = "tensorrt" if any(a.stage == "build-trt" for a in artifact.lineage()) else "onnxruntime"
    config, graphs = made_from.manifest["config"], graph_precisions(made_from)
    return f"{config['precision']} level {config['level']:g} ({ROLE_NAMES[role]} graph, {graphs[role]} outside Q/DQ)"


def quantized_from(artifact: Artifact) -> Artifact | None:
    """The quantize artifact in ``artifact``'s lineage (itself included), or None."""
    return next((a for a in artifact.lineage() if a.stage == STAGE), None)
