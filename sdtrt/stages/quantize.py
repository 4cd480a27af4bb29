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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import re
import shutil
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.artifact import Artifact
from ..core.config import QUANT_LEVELS, Component, ExportConfig, Precision, QuantizeConfig
from ..core.errors import ArtifactError, ConfigError, ExportError, MissingDependencyError, one_line
from ..core.progress import quiet_loading, step
from ..core.stage_request import StageRequest, digest, environment
from ..core.store import Store
from ..graph import onnx_graph
from ..sources.models import ModelSource
from ..spec import GraphSpec, denoiser_component
from . import calibration, export

if TYPE_CHECKING:
    import onnx
    import torch

STAGE = "quantize"
VERSION = 2  # 2: the TensorRT graph is 16-bit outside its Q/DQ pairs (it was the fp32 one)
# ModelOpt's diffusers example exports with opset 20; FP8 QuantizeLinear needs 19 or later.
OPSET = 20
# The layers NVIDIA keeps in high precision in a UNet: TensorRT demo/Diffusion's filter_func (proj_out included for
# UNets) and ModelOpt's filter_func_default.
ALWAYS_KEPT = re.compile(
    r".*(time_emb_proj|time_embedding|conv_in|conv_out|conv_shortcut|add_embedding|pos_embed|time_text_embed"
    r"|context_embedder|x_embedder|norm_out|proj_out).*"
)
ATTENTION_QUANTIZERS = (
    "q_bmm_quantizer",
    "k_bmm_quantizer",
    "v_bmm_quantizer",
    "softmax_quantizer",
    "bmm2_output_quantizer",
)
# In a transformer (SD3, Flux): ModelOpt's examples/diffusers/quantization/utils.py filter_func_flux_dev
# (time_text_embed, context_embedder, x_embedder, norm_out and the final proj_out, anchored: a Flux single block's
# proj_out is quantized) and filter_func_default, which its models.py gives SD3-Medium / SD3.5 (pos_embed), with
# the final proj_out kept for SD3 too, as its earlier quantize_lvl did for every backbone (``name != "proj_out"``).
TRANSFORMER_KEPT = re.compile(r"proj_out$|.*(pos_embed|time_text_embed|context_embedder|x_embedder|norm_out).*")
GRAPH = "{component}.onnx"  # unet.onnx, transformer.onnx
TRT_GRAPH = "{component}.trt.onnx"
FP8_ZERO_POINT = "sdtrt_fp8_zero_point"


def run(config: QuantizeConfig, model: ModelSource, store: Store) -> Artifact:
    """The quantized denoiser's graphs for ``model`` (a cache hit for the same model, config and calibration set)."""
    check_model(config, model)
    artifact, _ = store.produce(request_for(config, model), lambda out_dir: _quantize(config, model, out_dir))
    return artifact


def request_for(config: QuantizeConfig, model: ModelSource) -> StageRequest:
    """What ``run`` asks the store for: keyed by the model's denoiser, the graph contract, the config (precision,
    level, algorithm, layers kept) and a hash of the calibration set."""
    spec = denoiser_graph_spec(model, config)
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


def denoiser_graph_spec(model: ModelSource, config: QuantizeConfig = QuantizeConfig()) -> GraphSpec:
    """The contract of the artifact's primary graph, ONNX Runtime's (``graph_specs``)."""
    return graph_specs(model, config)["onnxruntime"]


def graph_specs(model: ModelSource, config: QuantizeConfig = QuantizeConfig()) -> dict[str, GraphSpec]:
    """Each graph's contract, by role (``tensorrt``, ``onnxruntime``): the denoiser's, in that graph's precision
    outside its Q/DQ pairs."""
    precisions: dict[str, Precision] = {
        "tensorrt": tensorrt_precision(model),
        # ModelOpt exports FP8 attention only from a 16-bit module (as_16_bit): level 4's graph is fp16 for both.
        "onnxruntime": "fp16" if attention_quantized(config) else "fp32",
    }
    component = denoiser_component(model)
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


def attention_quantized(config: QuantizeConfig) -> bool:
    """Level 4 quantizes attention (FP8 only: QuantizeConfig refuses INT8 there)."""
    return config.level >= 4


def check_model(config: QuantizeConfig, model: ModelSource) -> None:
    """ConfigError, from the model's configs alone (nothing loaded), when this model cannot be quantized so."""
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


def head_sizes(unet_config: dict[str, Any]) -> list[int]:
    """The attention head size of each UNet block (diffusers: channels // heads, the heads being
    ``num_attention_heads`` or, as SD 1.x/2.x configs spell it, ``attention_head_dim``)."""
    channels = unet_config["block_out_channels"]
    heads = unet_config.get("num_attention_heads") or unet_config["attention_head_dim"]
    heads = heads if isinstance(heads, list | tuple) else [heads] * len(channels)
    return [c // h for c, h in zip(channels, heads, strict=True)]


def transformer_head_sizes(config: dict[str, Any]) -> list[int]:
    """An SD3 / Flux transformer's one attention head size (diffusers names it ``attention_head_dim``)."""
    return [config["attention_head_dim"]]


@dataclass(frozen=True)
class DenoiserQuantization:
    """How NVIDIA quantizes one kind of denoiser: the modules it always keeps in high precision, and the levels
    that quantize anything in it, with why each other level is refused."""

    kept: re.Pattern[str]
    kept_why: str
    refused: dict[float, str]  # level → why
    head_sizes: Callable[[dict[str, Any]], list[int]]


UNET_QUANTIZATION = DenoiserQuantization(
    ALWAYS_KEPT, "kept by NVIDIA (embeddings, first/last and shortcut convolutions, proj_out)", {}, head_sizes
)
QUANTIZATION: dict[Component, DenoiserQuantization] = {
    "unet": UNET_QUANTIZATION,
    "transformer": DenoiserQuantization(
        TRANSFORMER_KEPT,
        "kept by NVIDIA (patch and text embedders, timestep embeddings, the output norm and projection)",
        {
            # SD3's one convolution is its patch embedding (pos_embed.proj, kept), and Flux has none.
            1.0: "a transformer's only convolution (SD3's patch embedding) stays in high precision: nothing would "
            "be quantized",
            # Level 4's fp16 export with FP8 attention is measured on UNets only (tiny-sd2); the transformers'
            # attention processors have not been through it.
            4.0: "sdtrt offers FP8 attention for UNets only so far",
        },
        transformer_head_sizes,
    ),
}


def denoiser_quantization(model: ModelSource) -> DenoiserQuantization:
    """How the model's denoiser is quantized: its kind's."""
    return QUANTIZATION[denoiser_component(model)]


@dataclass(frozen=True)
class LayerPlan:
    """Which Linear/Conv (and LayerNorm) modules are quantized, and why each other one is kept in high precision."""

    quantized: tuple[str, ...]
    kept: dict[str, str]  # module name → reason

    def disabled_entries(self) -> list[dict[str, Any]]:
        """ModelOpt quant_cfg entries switching the kept modules' quantizers off."""
        return [{"quantizer_name": f"{name}.*", "enable": False} for name in self.kept]


def plan_layers(
    network: torch.nn.Module, config: QuantizeConfig, kind: DenoiserQuantization = UNET_QUANTIZATION
) -> LayerPlan:
    """The layer selection for ``config``: the layers NVIDIA keeps in this ``kind`` of denoiser, the level's Linear
    layers, the user's list.

    ConfigError when ``keep_high_precision`` names a module the network does not have.
    """
    import torch

    names = {name for name, _ in network.named_modules()}
    if unknown := [name for name in config.keep_high_precision if name not in names]:
        raise ConfigError(
            f"keep_high_precision names {', '.join(unknown[:3])}, which the denoiser does not have; "
            "use module names such as down_blocks.0.attentions.0.proj_in"
        )
    quantized, kept = [], {}
    for name, module in network.named_modules():
        if not isinstance(module, torch.nn.Linear | torch.nn.Conv2d | torch.nn.LayerNorm):
            continue
        why = _kept_because(name, module, config, kind)
        if why is None:
            quantized.append(name)
        else:
            kept[name] = why
    return LayerPlan(tuple(quantized), kept)


def _kept_because(name: str, module: torch.nn.Module, config: QuantizeConfig, kind: DenoiserQuantization) -> str | None:
    import torch

    if any(name == kept or name.startswith(kept + ".") for kept in config.keep_high_precision):
        return "asked (keep_high_precision)"
    if kind.kept.match(name):
        return kind.kept_why
    level = config.level
    if isinstance(module, torch.nn.LayerNorm):
        # ModelOpt quantizes LayerNorms for FP8 attention fusion (nn/modules/quant_layernorm.py): level 4's.
        return None if level >= 4 else f"level {level:g}: LayerNorms are quantized with attention (level 4)"
    if isinstance(module, torch.nn.Linear):
        selected = (
            (level >= 2 and "ff.net" in name)
            or (level >= 2.5 and re.search(r"\.to_[qkv]$", name) is not None)
            or level >= 3
        )
        return None if selected else f"level {level:g}: {QUANT_LEVELS[level]}"
    return None  # convolutions: every level


def modelopt() -> Any:
    """``modelopt.torch.quantization``, or MissingDependencyError saying how to install it."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise MissingDependencyError(
            f"quantization needs NVIDIA ModelOpt ({one_line(exc)}); install it with pip install 'sdtrt[quant]' "
            "(never nvidia-modelopt[onnx]: it replaces onnxruntime with onnxruntime-gpu)"
        ) from exc
    return mtq


def modelopt_config(config: QuantizeConfig, plan: LayerPlan) -> dict[str, Any]:
    """ModelOpt's diffusers preset for the precision, with the plan's kept layers switched off."""
    mtq = modelopt()
    from modelopt.torch.quantization.config import _load_quantize_config_dict

    if config.algorithm == "smoothquant":
        base = mtq.INT8_SMOOTHQUANT_CFG
    else:  # examples/diffusers/quantization/config.py loads the same presets
        base = _load_quantize_config_dict(f"configs/ptq/presets/diffusers/{config.precision}")
    quant = copy.deepcopy(base)
    # fp32 model: ModelOpt's default "Half" asserts on fp32 inputs (the example's set_quant_config_attr sets it).
    for entry in quant["quant_cfg"]:
        cfg = entry.get("cfg")
        if isinstance(cfg, dict) and "num_bits" in cfg:
            cfg["trt_high_precision_dtype"] = "Float"
    if attention_quantized(config):
        # FP8 attention: the BMM inputs and the softmax output, as ModelOpt's diffusers plugin quantizes them
        # (plugins/diffusion/diffusers.py _quantized_sdpa; export_onnx.py export_fp8_mha), the BMM2 output not.
        fp8 = {"num_bits": (4, 3), "axis": None, "trt_high_precision_dtype": "Float"}
        quant["quant_cfg"] += [{"quantizer_name": f"*{q}", "cfg": dict(fp8)} for q in ATTENTION_QUANTIZERS[:4]]
        quant["quant_cfg"] += [{"quantizer_name": f"*{ATTENTION_QUANTIZERS[4]}", "enable": False}]
    else:  # attention stays in high precision below level 4, as TensorRT demo/Diffusion's fp8_mha_disable leaves it
        quant["quant_cfg"] += [{"quantizer_name": f"*{q}", "enable": False} for q in ATTENTION_QUANTIZERS]
    quant["quant_cfg"] += plan.disabled_entries()
    # Kept modules that own quantizers themselves (an attention's BMM quantizers, which the guard may return).
    quant["quant_cfg"] += [{"quantizer_name": f"{name}.*", "enable": False} for name in config.keep_high_precision]
    return quant


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


@contextlib.contextmanager
def _quiet() -> Any:
    """ModelOpt prints per-quantizer notices (``mtq.quantize``'s "Inserted N quantizers": a bare print in
    modelopt/torch/quantization/conversion.py) and warns about untested versions: progress lines say what runs, so
    its output is dropped (SDTRT_DEBUG=1 keeps it, on stderr)."""
    debug = os.environ.get("SDTRT_DEBUG", "") not in ("", "0")
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr if debug else io.StringIO()):
        if not debug:
            warnings.simplefilter("ignore")
        yield


def _quantize(config: QuantizeConfig, model: ModelSource, out_dir: Path) -> dict[str, Any]:
    quantized = quantized_denoiser(config, model)
    timings = dict(quantized.timings)
    specs = graph_specs(model, config)
    graphs = write_graphs(quantized.network, config, specs, out_dir, timings)
    plan = quantized.plan
    return {
        "primary": graphs["onnxruntime"],
        "family": model.family(),
        "io": specs["onnxruntime"].to_json(),
        "precision": {
            "graph": {role: spec.precision for role, spec in specs.items()},  # outside the Q/DQ pairs
            "quantized": config.precision,
            "why": {role: graph_precision_why(role, spec) for role, spec in specs.items()},
        },
        "graphs": graphs,
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
            "qdq": {role: qdq_counts(out_dir / name) for role, name in graphs.items()},
            "opset": OPSET,
        },
        "reproduce": (
            f"sdtrt quantize --model {model.name} --precision {config.precision} --level {config.level:g} "
            f"--calibration-steps {config.calibration_steps}"
        ),
    }


def graph_precision_why(role: str, spec: GraphSpec) -> str:
    if spec.precision == "fp32":
        return "fp32 outside the Q/DQ pairs: what ONNX Runtime's CPU provider runs well, with the same scales"
    if role == "onnxruntime":
        return "fp16 outside the Q/DQ pairs: ModelOpt exports FP8 attention only from a 16-bit module"
    fp32_ops = " (Resize, Sin and Cos computed in fp32, as for sdtrt's bf16 graphs)" if spec.precision == "bf16" else ""
    return (
        f"{spec.precision} outside the Q/DQ pairs{fp32_ops}, as NVIDIA exports this family's quantized denoiser: a "
        "strongly typed TensorRT build runs every op in the graph's type"
    )


def write_graphs(
    network: torch.nn.Module,
    config: QuantizeConfig,
    specs: dict[str, GraphSpec],
    out_dir: Path,
    timings: dict[str, float],
) -> dict[str, str]:
    """Export a quantized network as each role's spec asks (``graph_specs``) into ``out_dir``; returns each role's file
    and adds the steps' times to ``timings``.

    The network is changed in place: FP8 scales as ModelOpt's example exports them, then cast to the TensorRT graph's
    16-bit type after the fp32 export (it is left so)."""
    if config.precision == "fp8":
        fp8_scales_as_int8(network)
    trt, ort = specs["tensorrt"], specs["onnxruntime"]
    if trt.precision == ort.precision:  # level 4: one 16-bit export for both
        as_16_bit(network, trt.precision)
        return _export_graphs(network, config, trt, out_dir, timings, ("tensorrt", "onnxruntime"))
    graphs = _export_graphs(network, config, ort, out_dir, timings, ("onnxruntime",))
    as_16_bit(network, trt.precision)  # in place: the weights are never held twice
    return graphs | _export_graphs(network, config, trt, out_dir, timings, ("tensorrt",))


def _export_graphs(
    network: torch.nn.Module,
    config: QuantizeConfig,
    spec: GraphSpec,
    out_dir: Path,
    timings: dict[str, float],
    roles: tuple[str, ...],
) -> dict[str, str]:
    """One export of the network as ``spec``, written as the graph of each of ``roles``: the TensorRT graph keeps
    ModelOpt's trt:: FP8 ops, ONNX Runtime's has them rewritten; where there are none one file serves both."""
    started = time.perf_counter()
    graph, trt_graph = GRAPH.format(component=spec.component), TRT_GRAPH.format(component=spec.component)
    raw_dir = out_dir / "raw"
    raw_dir.mkdir()
    with step(f"Exporting the quantized {spec.label} in {spec.precision} (TorchScript exporter, opset {OPSET})"):
        _export(network, spec, raw_dir / graph)
    _add_time(timings, "export_s", started)

    started = time.perf_counter()
    with step(f"Writing the {' and '.join(ROLE_NAMES[role] for role in roles)} graph"):
        proto = onnx_graph.load_graph(raw_dir / graph, with_weights=True)
        onnx_graph.name_dynamic_axes(proto, spec)
        weight_bytes = onnx_graph.weights_on_disk(raw_dir)
        shutil.rmtree(raw_dir)  # its weights are in memory now: one copy on disk at a time (SD 1.5: 3.4 GB)
        if config.precision == "fp8":
            proto = convert_zp_fp8(_cleaned(proto))
        files = {}
        if "onnxruntime" not in roles:
            onnx_graph.save(proto, out_dir / trt_graph, weight_bytes)
            files["tensorrt"] = trt_graph
        else:
            if "tensorrt" in roles and any(node.domain == "trt" for node in proto.graph.node):  # level 4's FP8 ops
                onnx_graph.save_keeping_weights(proto, out_dir / trt_graph, weight_bytes)
                files["tensorrt"] = trt_graph
            standard_fp8_qdq(proto)
            onnx_graph.save(proto, out_dir / graph, weight_bytes)
            files = {role: graph for role in roles} | files
        del proto
        if spec.precision == "bf16":  # TensorRT builds this graph as it is (no simplify stage applies the passes)
            from .graph_passes import compute_in_fp32_file

            compute_in_fp32_file(out_dir / files["tensorrt"])
        for name in set(files.values()):
            onnx_graph.check(out_dir / name)
    _add_time(timings, "finalize_s", started)
    return files


ROLE_NAMES = {"tensorrt": "TensorRT", "onnxruntime": "ONNX Runtime"}


def _add_time(timings: dict[str, float], name: str, started: float) -> None:
    timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - started, 3)


def _export(network: torch.nn.Module, spec: GraphSpec, path: Path) -> None:
    """ModelOpt's fake-quant modules export their Q/DQ through the TorchScript exporter only (torch.export fails
    on them as shipped)."""
    import torch

    from .patches import export_patches

    module = export.graph_module(spec, network)
    config = ExportConfig(precision=spec.precision, opset=OPSET, exporter="torchscript", component=spec.component)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(spec.precision, torch.float32)
    with export_patches("torchscript"), torch.no_grad(), _quiet():
        try:
            export._torch_export(module, spec, config, "torchscript", path, dtype)
        except Exception as exc:
            raise ExportError(f"exporting the quantized {spec.label} failed: {one_line(exc)}") from exc


def fp8_scales_as_int8(network: torch.nn.Module) -> None:
    """ModelOpt's diffusers example's ``generate_fp8_scales``: the FP8 Linear/Conv quantizers export as INT8 Q/DQ
    whose scale is the FP8 one (amax·127/448 over 127 = amax/448); ``convert_zp_fp8`` then makes them FP8 Q/DQ.
    Changes the module in place: only for export."""
    import torch

    for module in network.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Conv2d) and hasattr(module, "input_quantizer"):
            quantizers: tuple[Any, ...] = (module.input_quantizer, module.weight_quantizer)
            for quantizer in quantizers:
                if quantizer.is_enabled and getattr(quantizer, "_amax", None) is not None:
                    quantizer._num_bits = 8
                    quantizer._amax = quantizer._amax * (127 / 448.0)


def as_16_bit(network: torch.nn.Module, precision: Precision) -> None:
    """Cast a network calibrated in fp32 to ``precision`` (fp16, bf16), its Q/DQ in that type too, in place: as NVIDIA
    exports 8-bit denoisers (``tensorrt_precision``), and ModelOpt exports FP8 attention only from a 16-bit module with
    16-bit Q/DQ (export_onnx.py export_fp8_mha: "the qdqs must be in 16 bits"). With ``trt_high_precision_dtype`` of
    the input's type, ``export_int8`` writes its scales in that type and no Cast around the Q/DQ (export_onnx.py:
    "TRT StronglyType requires both weights and amax to be in the BF16/FP16, or the QDQ in Float"); FP8 scales
    follow the input's type. PyTorch runs fp16 on the CPU (slowly): the export traces the smallest input."""
    import torch
    from modelopt.torch.quantization.nn import TensorQuantizer

    dtype, name = {"fp16": (torch.float16, "Half"), "bf16": (torch.bfloat16, "BFloat16")}[precision]
    with quiet_loading():  # diffusers' note on casting with to() instead of from_pretrained: nothing to act on
        network.to(dtype)
    for module in network.modules():
        if isinstance(module, TensorQuantizer):
            module.trt_high_precision_dtype = name


def _cleaned(proto: onnx.ModelProto) -> onnx.ModelProto:
    import onnx_graphsurgeon as gs

    graph = onnx_graph.import_for_surgery(proto)
    graph.cleanup().toposort()
    return gs.export_onnx(graph)


def convert_zp_fp8(proto: onnx.ModelProto) -> onnx.ModelProto:
    """ModelOpt's example's ``convert_zp_fp8``: the zero points of QuantizeLinear (and their DequantizeLinear)
    retyped from INT8 to FLOAT8E4M3FN; a zero is a zero in both, so only the type changes."""
    import onnx

    zero_points = {n.input[2] for n in proto.graph.node if n.op_type in _QDQ and len(n.input) > 2}
    for node in proto.graph.node:
        if node.op_type == "Constant" and node.output[0] in zero_points:
            node.attribute[0].t.data_type = onnx.TensorProto.FLOAT8E4M3FN
    for initializer in proto.graph.initializer:
        if initializer.name in zero_points:
            initializer.data_type = onnx.TensorProto.FLOAT8E4M3FN
    return proto


_QDQ = ("QuantizeLinear", "DequantizeLinear")
_TRT_FP8 = {"TRT_FP8QuantizeLinear": "QuantizeLinear", "TRT_FP8DequantizeLinear": "DequantizeLinear"}


def standard_fp8_qdq(proto: onnx.ModelProto) -> int:
    """Rewrite ModelOpt's ``trt::TRT_FP8QuantizeLinear``/``TRT_FP8DequantizeLinear`` to standard ONNX Q/DQ with a
    float8e4m3fn zero point (``saturate=1``, as TensorRT saturates), in place; returns how many were rewritten."""
    import onnx

    rewritten = set()
    for node in proto.graph.node:
        if node.domain == "trt" and node.op_type in _TRT_FP8:
            node.domain = ""
            node.op_type = _TRT_FP8[node.op_type]
            node.input.append(FP8_ZERO_POINT)
            if node.op_type == "QuantizeLinear":
                node.attribute.append(onnx.helper.make_attribute("saturate", 1))
            rewritten.update(node.output)
    if rewritten:
        zero = onnx.helper.make_tensor(FP8_ZERO_POINT, onnx.TensorProto.FLOAT8E4M3FN, [], [0])
        proto.graph.initializer.append(zero)
        # The exporter typed the trt:: quantize outputs uint8; shape inference retypes them from the zero point.
        kept = [v for v in proto.graph.value_info if v.name not in rewritten]
        del proto.graph.value_info[:]
        proto.graph.value_info.extend(kept)
    if not any(node.domain == "trt" for node in proto.graph.node):
        imports = [o for o in proto.opset_import if o.domain != "trt"]
        del proto.opset_import[:]
        proto.opset_import.extend(imports)
    return len(rewritten)


def qdq_counts(path: Path) -> dict[str, int]:
    """``op:TYPE`` → count of a graph's quantize/dequantize nodes, TYPE the zero point's (``INT8``,
    ``FLOAT8E4M3FN``); ModelOpt's ``trt::`` FP8 ops count as ``trt::op:FLOAT8E4M3FN``."""
    import onnx

    graph = onnx_graph.load_graph(path).graph
    types = {i.name: i.data_type for i in graph.initializer}
    types |= {n.output[0]: n.attribute[0].t.data_type for n in graph.node if n.op_type == "Constant" and n.attribute}
    counts: Counter[str] = Counter()
    for node in graph.node:
        if node.op_type in _QDQ and node.domain == "":
            zero_point = types.get(node.input[2]) if len(node.input) > 2 else None
            counts[f"{node.op_type}:{onnx.TensorProto.DataType.Name(zero_point) if zero_point else 'UINT8'}"] += 1
        elif node.domain == "trt" and node.op_type in _TRT_FP8:
            counts[f"trt::{node.op_type}:FLOAT8E4M3FN"] += 1
    return dict(sorted(counts.items()))


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
    its lineage), or None."""
    made_from = quantized_from(artifact)
    return None if made_from is None else str(made_from.manifest["config"]["precision"])


def precision_label(artifact: Artifact) -> str | None:
    """How a report names the precision of an artifact made from a quantize artifact: its format, level and the graph
    it runs, "int8 level 2.5 (ONNX Runtime graph, fp32 outside Q/DQ)" (a TensorRT engine runs the TensorRT graph,
    anything else ONNX Runtime's); None for any other artifact."""
    made_from = quantized_from(artifact)
    if made_from is None:
        return None
    role = "tensorrt" if any(a.stage == "build-trt" for a in artifact.lineage()) else "onnxruntime"
    config, graphs = made_from.manifest["config"], graph_precisions(made_from)
    return f"{config['precision']} level {config['level']:g} ({ROLE_NAMES[role]} graph, {graphs[role]} outside Q/DQ)"


def quantized_from(artifact: Artifact) -> Artifact | None:
    """The quantize artifact in ``artifact``'s lineage (itself included), or None."""
    return next((a for a in artifact.lineage() if a.stage == STAGE), None)
