"""Builds a TensorRT or TensorRT-RTX plan from an ONNX file; run as a child process by the build stage.

    python -m sdtrt.stages.trt_build_worker request.json

The request names the product (sdtrt/core/trt_products.py); this module imports its Python module and runs one path for
both: parse, the layer-precision and Q/DQ checks, profiles, strongly typed network, refit, stripped plans, weight
streaming, the build log. What only one product has (the timing cache, the builder optimization level, compute
capabilities) is asked of the product, never of the module. A crash or out-of-memory kill here cannot take the caller
down with it: the parent turns a non-zero exit into a BuildError that points at this process's log; a build this
module refuses exits 2 with its one-line reason in the result file. Only documented TensorRT 10 Python API calls are
used, with a strongly typed network (TensorRT 11 drops weak typing; TensorRT-RTX has nothing else), and every ``trt.``
name is checked in tests/test_tensorrt_api.py against TensorRT 10.13's published stubs and a list of the APIs
TensorRT 10 and 11 removed, and against the installed tensorrt_rtx module.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core.errors import one_line
from ..core.trt_products import PRODUCTS, Product, load, set_compute_capabilities

if TYPE_CHECKING:
    import tensorrt as trt

# The graph precision sdtrt exported → the DataType its layers compute in (a strongly typed network's layer outputs
# carry the type inferred from the graph: NvInfer.h kSTRONGLY_TYPED).
PRECISION_TYPES = {"fp32": "FLOAT", "fp16": "HALF", "bf16": "BF16"}
# DataType names as sdtrt spells precisions, for the manifest's layer count.
TYPE_NAMES = {
    "FLOAT": "fp32",
    "HALF": "fp16",
    "BF16": "bf16",
    "INT8": "int8",
    "FP8": "fp8",
    "FP4": "fp4",
    "INT4": "int4",
}


REFUSED_EXIT = 2


class Refused(Exception):
    """A build this worker will not run, for a reason one line says (the parent shows it as it is)."""


def warn(message: str) -> None:
    """Into the build log the parent keeps (this process's stdout and stderr)."""
    print(f"[sdtrt] warning: {message}", file=sys.stderr, flush=True)


def use_timing_cache(config: trt.IBuilderConfig, path: Path | None) -> None:
    """Give the build the timing cache at ``path`` if it fits this device and TensorRT, else an empty one.

    IBuilderConfig.set_timing_cache returns False when the cache does not match (pyCore.cpp,
    pyCoreDoc.h "set_timing_cache"): a cache made on another GPU must not fail the build. An unreadable
    file may give no cache at all (create_timing_cache → None; TensorRT's samples check for nullptr,
    shared/utils/cacheUtils.cpp).
    """
    data = path.read_bytes() if path and path.is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
        return
    warn(
        f"timing cache {path} is unreadable or was made for another GPU or TensorRT version; building with an empty one"
    )
    if not config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False):
        raise RuntimeError("TensorRT refused an empty timing cache")


def save_timing_cache(config: trt.IBuilderConfig, path: Path) -> None:
    """Add the build's timings to the cache file, atomically; a failure is a warning, never a lost engine.

    Builds sharing one file take turns under a lock, and each combines what the file holds now into its own
    cache before writing it, so no build's entries are lost (TensorRT's samples do the same in
    shared/utils/cacheUtils.cpp updateTimingCacheFile; Polygraphy's trt loader likewise).
    IBuilderConfig.get_timing_cache returns None when no cache is set (pyCoreDoc.h "get_timing_cache");
    ITimingCache.combine returns False, skipping everything, for a cache of another TensorRT version, or
    of another GPU with ignore_mismatch=False (pyCoreDoc.h ITimingCacheDoc "combine").
    """
    cache: trt.ITimingCache | None = config.get_timing_cache()
    if cache is None:
        warn("TensorRT kept no timing cache for this build; nothing written")
        return
    try:
        # Imported here: its flock is POSIX only, and elsewhere the cache is simply not saved, with the warning below.
        from ..core.locks import locked_beside, replace_file

        with locked_beside(path):  # exclusive: no other build writes between this read and the replace
            if path.is_file():
                on_file: trt.ITimingCache | None = config.create_timing_cache(path.read_bytes())
                if on_file is None or not cache.combine(on_file, ignore_mismatch=False):
                    warn(f"timing cache {path} is unreadable or from another GPU or TensorRT; this build's replaces it")
            # serialize may give no memory (TensorRT's shared/utils/cacheUtils.cpp checks for it)
            if (data := cache.serialize()) is None:
                raise RuntimeError("ITimingCache.serialize returned nothing")
            replace_file(path, bytes(data))
    except Exception as exc:  # the plan is on disk already: whatever fails here must not fail the build
        warn(f"could not write the timing cache {path} ({one_line(exc)}); the engine itself is built")


def select_device(index: int) -> None:
    """Build on the CUDA device the parent recorded: TensorRT builds for the calling thread's current CUDA
    device, device 0 in a fresh process (trtexec's --device does this cudaSetDevice, samples/common/sampleDevice.h)."""
    import torch

    torch.cuda.set_device(index)


def set_strip_flags(trt: ModuleType, config: trt.IBuilderConfig, refittable: bool) -> None:
    """A weight-stripped plan: STRIP_PLAN leaves the refittable weights out of it, and the runtime refills them
    from the ONNX graph (OnnxParserRefitter) before any execution context (NvInfer.h BuilderFlag::kSTRIP_PLAN
    "Strip the refittable weights from the engine plan file", TensorRT 10.0; samples/python/sample_weight_stripping).

    Which weights are refittable decides what is stripped. Without --refittable, REFIT_IDENTICAL: refittable on
    the promise that a refit brings the build's own values, so the builder optimizes as for a non-refittable
    engine ("The resulting engine will have the same performance as a non-refittable one ... When used alongside
    'kSTRIP_PLAN', this flag will result in a small plan file", NvInfer.h kREFIT_IDENTICAL, TensorRT 10.0).
    trtexec's --stripWeights leaves it to TensorRT's default ("The kREFIT_IDENTICAL is enabled by default when
    kSTRIP_PLAN is on", samples/common/sampleEngines.cpp); it is set here so the plan says so itself. With
    --refittable (REFIT, set by the caller) every weight is refittable with any values and all are stripped, as
    trtexec's --stripAllWeights (--refit --stripWeights, sampleOptions.cpp) does: LoRAs refit such a plan, where
    values other than the build's are undefined behaviour under REFIT_IDENTICAL. TensorRT-RTX has both flags and
    sets STRIP_PLAN with REFIT the same way (NVIDIA/TensorRT-RTX samples/apiUsage/python/api_usage.py).
    """
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)
    if not refittable:
        config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)


def layer_types(network: trt.INetworkDefinition) -> tuple[dict[str, int], dict[str, int]]:
    """The parsed network's layers counted by their (first) output's type, and its Quantize layers by the type they
    quantize to ("INT8", "FP8"): what will be built, not what was asked for.

    In a strongly typed network each tensor's type is inferred as layers are added (NvInfer.h kSTRONGLY_TYPED), so an
    output's dtype is the type its layer computes in, and a Quantize layer's output is the quantized type. ONNX
    QuantizeLinear and ModelOpt's ``trt::TRT_FP8QuantizeLinear`` both become Quantize layers: the ONNX parser imports
    that custom op itself, no plugin library is loaded (onnx-tensorrt onnxOpImporters.cpp,
    DEFINE_BUILTIN_OP_IMPORTER(TRT_FP8QuantizeLinear) → QuantDequantLinearHelper with DataType::kFP8); a standard
    QuantizeLinear quantizes to its zero point's type, INT8 or FP8. Layer types are compared by name (ILayer.type is
    a LayerType), so this reads either product's network.
    """
    layers: dict[str, int] = {}
    quantized: dict[str, int] = {}
    for index in range(network.num_layers):
        layer: trt.ILayer = network.get_layer(index)
        if layer.num_outputs == 0:
            continue
        dtype = layer.get_output(0).dtype.name
        layers[dtype] = layers.get(dtype, 0) + 1
        if layer.type.name == "QUANTIZE":
            quantized[dtype] = quantized.get(dtype, 0) + 1
    return layers, quantized


def layer_summary(layers: dict[str, int]) -> str:
    """ "1204 layers: 1150 fp16, 54 fp32" — most first; types sdtrt has no precision name for keep TensorRT's."""
    parts = [f"{n} {TYPE_NAMES.get(t, t.lower())}" for t, n in sorted(layers.items(), key=lambda kv: (-kv[1], kv[0]))]
    return f"{sum(layers.values())} layers: {', '.join(parts)}"


def check_layers(request: dict[str, Any], layers: dict[str, int], quantized: dict[str, int], label: str) -> None:
    """Refused: a network with no layer in the graph's precision (TensorRT 11 builds an "fp16" engine from an fp32
    graph without a word, roboflow/rf-detr#1453), or a Q/DQ graph without Quantize layers of its 8-bit type."""
    precision = request["precision"]
    if not layers.get(PRECISION_TYPES[precision]):
        raise Refused(
            f"{request['onnx']} is meant to be a {precision} graph, but {label} parsed no {precision} layer from it "
            f"({layer_summary(layers)}); export it again with --precision {precision}"
        )
    if wanted := request.get("quantization"):
        # Only the wanted 8-bit type: an INT8 Q/DQ left in an FP8 graph would clip at its FP8-derived scale.
        other = {"INT8": "FP8", "FP8": "INT8"}[wanted.upper()]
        if not quantized.get(wanted.upper()) or quantized.get(other):
            raise Refused(
                f"{request['onnx']} is meant to be an {wanted.upper()} Q/DQ graph, but {label} parsed {other} or no "
                f"{wanted.upper()} Quantize layers from it (found {quantized or 'none'}); quantize the model again "
                "with `sdtrt quantize`"
            )


def parser_refusal(parser: trt.OnnxParser, label: str) -> Refused:
    """The parser's first error as one line naming the node and its op (IParserError.node_name/node_operator/desc,
    pyOnnx.cpp); the rest are in the log."""
    for index in range(parser.num_errors):
        print(f"[sdtrt] ONNX parser error: {parser.get_error(index)}", file=sys.stderr, flush=True)
    if not parser.num_errors:  # a failure the parser only logged: get_error(0) would be None
        return Refused(f"{label}'s ONNX parser refused the graph and recorded no error; see the build log")
    first = parser.get_error(0)
    where = f"node {first.node_name()} ({first.node_operator()})" if first.node_operator() else "the graph"
    more = f"; {parser.num_errors - 1} more in the log" if parser.num_errors > 1 else ""
    return Refused(
        f"{label}'s ONNX parser refused {where}: {one_line(first.desc())}{more}; build this graph with another target "
        "(--target onnxruntime) or report the op"
    )


def build(request: dict[str, Any]) -> dict[str, Any]:
    which: Product = PRODUCTS[request.get("product", "tensorrt")]
    # The product's module under the name the annotations below use: they name TensorRT's classes for
    # tests/test_tensorrt_api.py, and mypy takes this local for a variable there (hence the ignores).
    trt = load(which)
    if which.builds_on_gpu:  # TensorRT-RTX builds ahead of time, for the compute capabilities it is given
        select_device(request.get("device", 0))
    logger = trt.Logger(trt.Logger.INFO)
    builder: trt.Builder = trt.Builder(logger)  # type: ignore[name-defined]
    # Strongly typed: every tensor's type follows from the graph's inputs, casts and Q/DQ nodes (pyCoreDoc.h
    # NetworkDefinitionCreationFlagDoc). That is explicit quantization for INT8/FP8 Q/DQ graphs as well, as ModelOpt's
    # diffusers example builds them (`trtexec --stronglyTyped`); TensorRT 11 ignores the flag, always strongly typed.
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network: trt.INetworkDefinition = builder.create_network(flags)  # type: ignore[name-defined]
    parser: trt.OnnxParser = trt.OnnxParser(network, logger)  # type: ignore[name-defined]
    # parse_from_file, never parse(bytes): the parser reads the file itself and resolves external data
    # (unet.onnx.data) beside it, so this process never holds the graph's weights as one Python bytes object
    # (python/src/parsers/pyOnnx.cpp parseFromFile -> IParser::parseFromFile; onnx-tensorrt ModelImporter::
    # parseFromFile calls setOnnxFileLocation for its weights). parse(bytes) without a path finds no .data file.
    if not parser.parse_from_file(request["onnx"]):
        raise parser_refusal(parser, which.label)
    layers, quantized = layer_types(network)
    print(f"[sdtrt] parsed network: {layer_summary(layers)}", file=sys.stderr, flush=True)
    check_layers(request, layers, quantized, which.label)

    config: trt.IBuilderConfig = builder.create_builder_config()  # type: ignore[name-defined]
    # Strongly typed: bf16, fp16 and fp32 graphs all build from the types in the graph, with no precision flag
    # (BuilderFlag.BF16/FP16 are weak typing, removed in TensorRT 11; pyCoreDoc.h NetworkDefinitionCreationFlagDoc).
    # So do INT8 and FP8 Q/DQ graphs: BuilderFlag.INT8 and FP8 are "Deprecated in TensorRT 10.12. Superseded by strong
    # typing" (pyCoreDoc.h BuilderFlagDoc, NvInfer.h BuilderFlag kINT8/kFP8; FP8 only ever enabled FP8 plugin I/O).
    # trtexec --stronglyTyped drops them all ("setting fp16/int8/bf16/fp8/int4 mode is not allowed if graph is strongly
    # typed", samples/common/sampleOptions.cpp BuildOptions::parse) and keeps TF32, which still governs the fp32
    # tensors of a 16-bit graph (the timestep, Flux's rotary positions; NvInfer.h kTF32: "computations on tensors of
    # type DataType::kFLOAT"). A Q/DQ graph's types are its own: the parser adds a QuantizeLinear (opset 19+) with its
    # scale's type and a DequantizeLinear whose output is its scale's type (onnx-tensorrt onnxOpImporters.cpp
    # QuantDequantLinearHelper, strongly typed branch), and a 16-bit scale must be of its input's type (NvInfer.h
    # IQuantizeLayer), as the quantize stage exports them (quantize_export.as_16_bit).
    if which.optimization_level:
        config.builder_optimization_level = request["optimization_level"]
    if which.compute_capabilities:
        set_compute_capabilities(trt, config, request.get("compute_capabilities", []))  # TensorRT-RTX's API only
    if request.get("refittable"):
        # REFIT: every weight refittable with any new values (LoRAs). Not REFIT_IDENTICAL, which lets the
        # builder assume refits bring the build's own values (pyCoreDoc.h BuilderFlagDoc; Polygraphy's
        # --refittable sets REFIT the same way).
        config.set_flag(trt.BuilderFlag.REFIT)
    if request.get("strip_weights"):
        set_strip_flags(trt, config, refittable=bool(request.get("refittable")))
    if request.get("weight_streaming"):
        # WEIGHT_STREAMING: the plan keeps its weights in host memory and the runtime streams those over the budget
        # it is given (ICudaEngine.weight_streaming_budget_v2; pyCoreDoc.h BuilderFlagDoc, NvInfer.h
        # kWEIGHT_STREAMING). TensorRT's developer guide asks for a strongly typed network, which this always is.
        config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
    if not request.get("tf32", True):
        # TF32 is on by default (pyCoreDoc.h BuilderFlagDoc, TF32: "Enabled by default."):
        # an fp32 engine computes in fp32 only with it cleared, as Polygraphy's CreateConfig(tf32=False) does.
        config.clear_flag(trt.BuilderFlag.TF32)
    if request["workspace_bytes"]:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request["workspace_bytes"])
    for shapes in request["profiles"]:
        profile: trt.IOptimizationProfile = builder.create_optimization_profile()  # type: ignore[name-defined]
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        # add_optimization_profile returns the profile's index, -1 when the profile is invalid (pyCoreDoc.h).
        if config.add_optimization_profile(profile) < 0:
            raise RuntimeError(f"TensorRT rejected the optimization profile {shapes}")

    cache_path = Path(request["timing_cache"]) if which.timing_cache and request.get("timing_cache") else None
    if which.timing_cache:  # never for TensorRT-RTX: a timing cache there makes the AOT build look for a GPU
        use_timing_cache(config, cache_path)

    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"builder.build_serialized_network returned None; see the {which.label} messages above")
    Path(request["plan"]).write_bytes(plan)
    if cache_path:
        save_timing_cache(config, cache_path)  # after the plan is safe on disk
    return {
        "build_s": time.perf_counter() - started,
        "version": trt.__version__,
        "layers": network.num_layers,
        "layer_types": layers,
        "quantize_layers": quantized,
    }


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = build(request)
    except Refused as exc:  # the parent shows this line as the build's error
        print(f"[sdtrt] refused: {exc}", file=sys.stderr, flush=True)
        Path(request["result"]).write_text(json.dumps({"refused": str(exc)}))
        sys.exit(REFUSED_EXIT)
    Path(request["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
