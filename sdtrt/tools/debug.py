"""``sdtrt debug``: the first layer whose reduced-precision output leaves fp32's, or turns NaN/inf.

The question every "fp16 gives black images" report asks. The engine's graph and an fp32 replica of the
very same graph (every fp16 and bf16 weight, cast and tensor widened to fp32, ModelOpt's trt:: FP8 Q/DQ
made standard, so node and tensor names match one to one and only the arithmetic differs) run on one
seeded input, at a size generate would take, with every intermediate tensor marked as an output —
Polygraphy's ``ModifyOutputs`` / ``ModifyNetworkOutputs`` with ``MARK_ALL`` and its ``Comparator`` — and
the engine's tensors are checked in the graph's topological order. ONNX graphs run on ONNX Runtime; a
TensorRT engine is rebuilt from the graph it was made from with every tensor an output (TensorRT cannot
expose the layers of a built plan).

A tensor diverges when its normalised error, max |engine − fp32| / max |fp32|, exceeds the limit
(default 0.05; healthy fp16 graphs stay near 1e-3 per layer), or when it holds NaN/inf while the
fp32 one does not.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import ParityError, WrongArtifactError
from ..graph import onnx_graph
from ..graph.onnx_graph import artifact_spec, graph_of

if TYPE_CHECKING:
    from pathlib import Path

    import onnx
    import torch

    from ..core.artifact import Artifact
    from ..core.config import ShapeProfile
    from ..sources.models import ModelSource
    from ..spec import GraphSpec


@dataclass(frozen=True)
class DebugConfig:
    max_error: float = 0.05  # normalised max abs error a tensor may have against the fp32 replica
    seed: int = 0
    # Default: the profile's smallest size. Every intermediate tensor is kept, twice: memory grows
    # with the image (attention maps with its square).
    height: int | None = None
    width: int | None = None


@dataclass
class DebugReport:
    engine: str
    backend: str  # what ran the engine's graph: onnxruntime or tensorrt
    limit: float  # the normalised error past which a tensor diverges
    compared: int  # intermediate tensors compared
    largest_error: float
    first: dict[str, Any] | None = None  # the first divergent tensor: node, op, tensor, error, finite
    worst: list[dict[str, Any]] = field(default_factory=list)  # the largest errors, for a healthy engine too
    # Every compared tensor in the graph's order (node, op, tensor, error, finite): where the error grows, drawn by the
    # HTML report (sdtrt report --debug).
    layers: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.first is None

    def problem(self) -> str | None:
        """Which tensor diverges first and what to do, or None for a healthy engine."""
        if self.first is None:
            return None
        what = "turns NaN/inf" if not self.first["finite"] else f"diverges (error {self.first['error']:.3g})"
        return (
            f"{self.first['tensor']}, output of {self.first['op']} node '{self.first['node']}', {what} first; "
            "look at that layer's weights and inputs, or build it in fp32"
        )

    def raise_for_status(self) -> None:
        if problem := self.problem():
            raise ParityError(problem)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"passed": bool(self)}


def fp32_replica(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every fp16 and bf16 weight, cast target and tensor type widened to fp32."""
    import onnx
    import onnx_graphsurgeon as gs

    graph = onnx_graph.import_for_surgery(model)
    for tensor in graph.tensors().values():
        # A Constant's dtype is read before its values load, so FP8 zero points and other weights stay as stored.
        if isinstance(tensor, gs.Constant) and _narrow(tensor.dtype):
            tensor.values = _widened(tensor.values)
        elif isinstance(tensor, gs.Variable) and _narrow(tensor.dtype):
            tensor.dtype = np.float32
    for node in graph.nodes:
        if node.op == "Cast" and node.attrs.get("to") in _NARROW_TYPES:
            node.attrs["to"] = onnx.TensorProto.FLOAT
        for value in node.attrs.values():  # e.g. ConstantOfShape's value
            if isinstance(value, gs.Constant) and _narrow(value.dtype):
                value.values = _widened(value.values)
    return gs.export_onnx(graph)


def reference_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """What ONNX Runtime runs as the fp32 truth for ``model``: its fp32 replica, with ModelOpt's ``trt::`` FP8 Q/DQ
    (FP8 level 4's TensorRT graph; only TensorRT's ONNX parser has importers for that domain) as standard ONNX Q/DQ.
    Node and tensor names stay those of ``model``."""
    from ..stages.qdq import standard_fp8_qdq

    replica = fp32_replica(model)  # a new proto: the rewrite below leaves ``model`` as TensorRT parses it
    standard_fp8_qdq(replica)
    return replica


# onnx-graphsurgeon types what numpy lacks (bf16) by its TensorProto enum (0.5+: importers/onnx_importer.py
# get_onnx_tensor_dtype, and LazyValues.dtype before a Constant's values load); loaded bf16 values are
# ml_dtypes.bfloat16 arrays (onnx >= 1.19 numpy_helper.to_array).
_NARROW_TYPES = (10, 16)  # onnx.TensorProto.FLOAT16, BFLOAT16: onnx.proto fixes these enum values


def _narrow(dtype: Any) -> bool:
    """Whether an onnx-graphsurgeon dtype (numpy dtype, TensorProto enum, or None: unknown) is fp16 or bf16."""
    import ml_dtypes

    if dtype is None:
        return False
    if isinstance(dtype, int):
        return dtype in _NARROW_TYPES
    return np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _widened(values: np.ndarray) -> np.ndarray:
    """fp32 values of fp16 or bf16 ones. bf16 is fp32's upper 16 bits, so its bits are widened rather than its
    dtype cast: that also reads onnx 1.18's uint16-based bfloat16 arrays right. onnx <= 1.17 loads bf16 as fp32."""
    if values.dtype.itemsize == 4 or values.dtype == np.float16:
        return values.astype(np.float32)
    return np.asarray(values.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)  # 0-d: a scalar


@contextlib.contextmanager
def quiet_polygraphy() -> Iterator[None]:
    """Polygraphy logs every tensor it marks to stdout; keep stdout for results and its noise out."""
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.ERROR), contextlib.redirect_stdout(sys.stderr):
        yield


def debug(engine: Artifact, config: DebugConfig = DebugConfig(), model: ModelSource | None = None) -> DebugReport:
    """Find the first tensor where ``engine`` leaves the fp32 replica of its own graph."""
    if engine.stage == "wrap":  # a TorchScript-wrapped plan: the build-trt engine it embeds
        engine = engine.lineage()[1]
    spec, profile, size = _checked(engine, config, model)
    graph_artifact = graph_of(
        engine,
        f"debug takes one ONNX graph or TensorRT engine, not a '{engine.stage}' artifact ({engine.path}); pass "
        "the artifact a `build` printed (debug_set takes an engine set)",
    )

    import onnx
    from polygraphy import constants
    from polygraphy.backend.onnx import ModifyOutputs
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    from ..stages.quantize import tensorrt_graph

    # A plan runs the graph its build parsed: for a quantized one the quantize stage's TensorRT graph (16-bit outside
    # its Q/DQ pairs, as the engine's IO), not the ONNX Runtime graph that is its source's primary.
    graph = tensorrt_graph(graph_artifact) if engine.stage == "build-trt" else graph_artifact.primary
    candidate = onnx.load(str(graph))
    feeds = _feeds(spec, profile, *size, config.seed)

    def session(graph: onnx.ModelProto, name: str) -> Any:
        """ONNX Runtime reads the every-tensor-an-output graph from a file with external data: serialized whole, as
        Polygraphy's BytesFromOnnx does (SerializeToString), any real UNet's fp32 replica is past protobuf's 2 GB."""
        path = f"{scratch}/{name}.onnx"
        marked = ModifyOutputs(graph, outputs=constants.MARK_ALL)()
        onnx.save_model(marked, path, save_as_external_data=True, location=f"{name}.onnx.data", size_threshold=1024)
        return SessionFromOnnx(path, providers=["cpu"])

    with tempfile.TemporaryDirectory(prefix="sdtrt-debug-") as scratch:
        reference = OnnxrtRunner(session(reference_graph(candidate), "fp32"), name="fp32")
        if engine.stage == "build-trt":
            from ..stages.build_trt import built_with_tf32

            tf32 = built_with_tf32(engine.manifest)
            runner, backend = _tensorrt_runner(graph, feeds, tf32, qdq_tensors(candidate)), "tensorrt"
        else:
            runner, backend = OnnxrtRunner(session(candidate, "engine"), name="engine"), "onnxruntime"
        with quiet_polygraphy():
            results = Comparator.run([runner, reference], data_loader=[feeds])
    (_, [got]), (_, [expected]) = list(results.items())
    return _compare(str(engine.path), backend, candidate, got, expected, config.max_error)


def debug_set(engine_set: Artifact, config: DebugConfig = DebugConfig()) -> dict[str, DebugReport]:
    """``debug`` on each member of an engine set, by component (each member records its own graph contract); every
    member's size is checked before the first one runs."""
    from ..stages.engine_set import members

    engines = members(engine_set)
    # The largest grid first: the denoiser's, the set's (generate's SizeRule), so an off-grid side is named as such.
    for member in sorted(engines.values(), key=lambda member: -artifact_spec(member).pixel_multiple):
        _checked(member, config)
    return {component: debug(member, config) for component, member in engines.items()}


def _checked(
    engine: Artifact, config: DebugConfig, model: ModelSource | None = None
) -> tuple[GraphSpec, ShapeProfile, tuple[int, int]]:
    """The engine's graph contract, profile (default: its spec's) and the image size to debug it at (default: the
    profile's smallest), or an error before anything loads (no torch yet): RequestError for a size generate would
    refuse (off the model's grid, outside the profile the engine records; every intermediate tensor is kept, so a
    size past it can take tens of GB), WrongArtifactError for a bf16 graph that would run on ONNX Runtime."""
    from ..pipeline.request import check_size
    from ..stages.engine_set import engine_members, engine_profile

    spec = artifact_spec(engine, model)
    if spec.precision == "bf16" and engine.stage != "build-trt":
        raise WrongArtifactError(
            f"{engine.path} is a bf16 graph, and debug runs ONNX graphs on ONNX Runtime, which cannot run bf16 (it has "
            "no bfloat16 Conv, Gemm or Add kernels): debug the TensorRT engine built from it"
        )
    recorded = engine_profile(engine_members(engine))
    profile = recorded or spec.default_profile()
    height = profile.height.min if config.height is None else config.height
    width = profile.width.min if config.width is None else config.width
    check_size(height, width, spec.pixel_multiple, recorded)
    return spec, profile, (height, width)


def _feeds(spec: GraphSpec, profile: ShapeProfile, height: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """One seeded input in the graph's own dtypes: the profile's smallest batch (the UNet's doubled, as guidance
    does) and, for graphs that take T5 tokens, its fewest tokens.

    torch tensors, as Polygraphy has a bf16 type only in its torch table (datatype/torch.py; datatype/numpy.py has
    none): fed torch tensors, TrtRunner allocates torch outputs and views them in the engine's dtypes
    (backend/trt/runner.py _infer_impl, use_torch), OnnxrtRunner returns torch tensors (Polygraphy 0.53.6).
    """
    import torch

    from ..spec import UNetSpec

    batch = 2 * profile.batch.min if isinstance(spec, UNetSpec) else profile.batch.min
    tensors = spec.sample_inputs(batch, height, width, seed=seed, tokens=spec.token_counts(profile).min)
    return {t.name: tensors[t.name].to(getattr(torch, t.dtype)) for t in spec.inputs()}


def _tensorrt_runner(graph: Path, feeds: dict[str, torch.Tensor], tf32: bool, quantized: set[str]) -> Any:
    """A TensorRT engine of ``graph`` with every tensor but the ``quantized`` ones an output, for exactly these
    input shapes.

    Polygraphy's TRT backend: NetworkFromOnnxPath (strongly typed, as sdtrt builds), ModifyNetworkOutputs
    with MARK_ALL, one static Profile, EngineFromNetwork, TrtRunner (tools/Polygraphy/polygraphy/backend/trt/).
    ``tf32`` as the engine was built: CreateConfig clears BuilderFlag.TF32 unless told (its tf32=None means
    off, backend/trt/config.py), TensorRT's own default is on.
    """
    from ..core.gpu import require_tensorrt

    require_tensorrt("debug a TensorRT engine")
    from polygraphy import constants
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineFromNetwork,
        ModifyNetworkOutputs,
        NetworkFromOnnxPath,
        PostprocessNetwork,
        Profile,
        TrtRunner,
    )

    profile = Profile()
    for name, tensor in feeds.items():
        shape = tuple(tensor.shape)
        profile.add(name, min=shape, opt=shape, max=shape)
    network = ModifyNetworkOutputs(NetworkFromOnnxPath(str(graph), strongly_typed=True), outputs=constants.MARK_ALL)
    network = PostprocessNetwork(network, func=functools.partial(unmark_outputs, names=quantized))
    return TrtRunner(EngineFromNetwork(network, config=CreateConfig(tf32=tf32, profiles=[profile])), name="engine")


def qdq_tensors(model: onnx.ModelProto) -> set[str]:
    """The outputs of a graph's Q/DQ pairs (ModelOpt's ``trt::`` FP8 ones too), which debug marks as no TensorRT output.

    A quantize node's output is 8-bit, which Polygraphy cannot view (neither its torch nor its numpy dtype table has
    fp8: datatype/torch.py, datatype/numpy.py; util.array.view, 0.53.6). A dequantize node's output left marked would
    have to be computed as a tensor of its own, so TensorRT could not fold the pair into its consumer's 8-bit kernel,
    and debug would compare a 16-bit engine instead of the quantized one (TensorRT's developer guide, "Q/DQ Layer
    Placement": the DQ is fused into the following Conv or MatMul).
    """
    ops = ("QuantizeLinear", "TRT_FP8QuantizeLinear", "DequantizeLinear", "TRT_FP8DequantizeLinear")
    return {tensor for node in model.graph.node if node.op_type in ops for tensor in node.output}


def unmark_outputs(network: Any, names: set[str]) -> None:
    """Unmark the network outputs among ``names`` (a TensorRT INetworkDefinition; names not in it are ignored)."""
    for tensor in [network.get_output(i) for i in range(network.num_outputs)]:
        if tensor.name in names:
            network.unmark_output(tensor)


def _compare(engine: str, backend: str, graph: onnx.ModelProto, got: Any, expected: Any, limit: float) -> DebugReport:
    """Walk the graph's nodes in order; the first output past ``limit`` (or newly non-finite) is the culprit."""
    report = DebugReport(engine, backend, limit, compared=0, largest_error=0.0)
    rows = []
    for node in graph.graph.node:
        for tensor in node.output:
            if tensor not in got or tensor not in expected:
                continue  # not an output of this backend (TensorRT fuses some layers away)
            a, b = _numpy(got[tensor]), _numpy(expected[tensor])
            if a.dtype.kind not in "fc" or a.size == 0 or a.shape != b.shape:
                continue
            a, b = a.astype(np.float64), b.astype(np.float64)
            # Non-finite values fp32 has too are the graph's own (CLIP's -inf causal mask, log(0) in T5's
            # position buckets): only values that turn NaN/inf here diverge, the others are compared.
            finite = not (np.isfinite(b) & ~np.isfinite(a)).any()
            both = np.isfinite(a) & np.isfinite(b)
            scale = np.abs(b[both]).max(initial=0.0) + 1e-6
            error = float(np.abs(a[both] - b[both]).max(initial=0.0) / scale) if finite else float("inf")
            row = {"node": node.name, "op": node.op_type, "tensor": tensor, "error": error, "finite": finite}
            rows.append(row)
            if report.first is None and (not finite or error > limit):
                report.first = row
    report.compared = len(rows)
    report.layers = rows
    report.largest_error = max((r["error"] for r in rows), default=0.0)
    report.worst = sorted(rows, key=lambda r: r["error"], reverse=True)[:5]
    return report


def _numpy(value: Any) -> np.ndarray:
    """A runner's output as numpy. Of torch's dtypes numpy lacks, bf16 compares as fp32 and FP8 (the quantized
    tensor of a Q/DQ pair) stays bytes, as ONNX Runtime returns it, which ``_compare`` skips."""
    import torch

    if not isinstance(value, torch.Tensor):
        return np.asarray(value)
    if value.dtype == torch.bfloat16:
        value = value.float()
    elif value.is_floating_point() and value.element_size() == 1:
        value = value.view(torch.uint8)
    return value.numpy(force=True)
