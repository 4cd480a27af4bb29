"""A weight-stripped TensorRT plan (--strip-weights): the graph its weights come back from, checked, and the refill."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..core.artifact import Artifact, located
from ..core.errors import ArtifactError
from ..core.stage_request import digest

if TYPE_CHECKING:
    import tensorrt as trt


def graph_digest(source: Artifact) -> str:
    """The content of a store artifact's files (its graph and external data), from the sha256 its manifest holds."""
    return digest(sorted([f["name"], f["sha256"]] for f in source.manifest.get("files", [])))


def refill_graph(manifest: dict[str, Any], plan: Path) -> Path | None:
    """The ONNX graph that refills a weight-stripped plan, checked against the digest its build recorded; None for
    a plan that holds its weights. ArtifactError when the graph is gone, changed or corrupt."""
    weights = manifest.get("weights", {})
    if weights.get("in_plan", True):
        return None
    recorded = weights["refill_from"]
    where = located(Path(recorded["artifact"]), plan.parents[2])  # in the plan's own store first
    try:
        source = Artifact.open(where)
        problem = next(iter(source.file_problems()), None)
        if problem is None and graph_digest(source) != recorded["digest"]:
            problem = "it was made again since, with other content"
    except ArtifactError:
        problem = "it is gone"
    if problem:
        raise ArtifactError(
            f"{plan} holds no weights (built with --strip-weights): every load refills them from the graph "
            f"{where / recorded['graph']}, and {problem}; make the graph and the engine again with the same "
            "`sdtrt compile` (or simplify, then `sdtrt build`), or build the engine without --strip-weights"
        )
    source.mark_used()  # every load uses it: `gc --older-than` must not remove it from under a plan in use
    return source.primary


def refill_weights(trt: ModuleType, engine: trt.ICudaEngine, logger: trt.ILogger, graph: Path, plan: Path) -> None:
    """Put a weight-stripped plan's weights back from the ONNX graph it was built from, before any execution context.

    As samples/python/sample_weight_stripping/refit_engine_and_infer.py does (TensorRT 10.0 on): a Refitter over
    the engine, an OnnxParserRefitter over that (python/src/parsers/pyOnnx.cpp, "refitter"_a, "logger"_a),
    refit_from_file, then refit_cuda_engine. refit_from_file reads the graph and its external data from the file's
    folder and sets every refittable weight by its initializer's name; it returns False, with the parser's errors,
    when the graph cannot be read or does not supply every refittable weight (onnx-tensorrt
    ModelRefitter::refitFromFile; "Failed to refit all the weights.", kREFIT_FAILED). It does not refit the engine
    itself: refit_cuda_engine does, and returns False when validation fails or weights are missing (pyCoreDoc.h
    RefitterDoc). Before the context: with WEIGHT_STREAMING the weights sit in host memory from deserialization
    until create_execution_context splits them between host and GPU (NvInfer.h kWEIGHT_STREAMING), so the refit
    writes them where the split takes them from, and the budget is set after it, as before.
    """
    failed = f"TensorRT could not refill the weights of {plan} (built with --strip-weights) from {graph}"
    # createInferRefitter gives no refitter for an engine that is not refittable ("Parameter check failed ...
    # condition: e.isRefittable()", NVIDIA/TensorRT#2783), and pybind11 turns a factory's nullptr into a bare
    # TypeError (pyCore.cpp binds trt.Refitter through py::init(factory)).
    if not engine.refittable:
        raise ArtifactError(f"{failed}: the plan is not refittable, so it cannot be stripped; rebuild the engine")
    refitter: trt.Refitter = trt.Refitter(engine, logger)  # type: ignore[name-defined]
    # The parser refitter owns the weights it reads (onnx-tensorrt ModelRefitter: convertOnnxWeights with
    # ownAllWeights) and hands TensorRT pointers to them, which must stay valid until refit_cuda_engine returns
    # (NvInferRuntime.h setNamedWeights): it lives to the end of this function, and the refitter keeps it alive
    # (pyOnnx.cpp py::keep_alive<2, 1>). Both go when this returns, with their host copy of every weight.
    parser: trt.OnnxParserRefitter = trt.OnnxParserRefitter(refitter, logger)  # type: ignore[name-defined]
    if not parser.refit_from_file(str(graph)):
        # Some onnx-tensorrt versions only log a failure (ONNXTRT_CATCH_LOG), leaving num_errors at 0.
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "see its messages above"
        raise ArtifactError(f"{failed}: {errors}; rebuild the engine from this graph")
    # Names; pyCoreDoc.h says "" for unnamed weights, but pybind11 casts a null char const* to None.
    if missing := refitter.get_missing_weights():
        raise ArtifactError(
            f"{failed}: {len(missing)} weights are still missing (first: '{missing[0] or '<unnamed>'}'); rebuild the "
            "engine from this graph"
        )
    if not refitter.refit_cuda_engine():
        raise ArtifactError(f"{failed}: refit_cuda_engine returned False; see the TensorRT messages above")
