"""`sdtrt debug`: real ONNX Runtime runs of an engine and its fp32 replica, every tensor an output (Polygraphy)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import ExportConfig, SimplifyConfig
from sdtrt.core.errors import ParityError, WrongArtifactError
from sdtrt.stages import export, simplify
from sdtrt.tools.debug import debug, fp32_replica, reference_graph

from .helpers import last_line, plant_fp16_overflow, run_cli


@pytest.fixture(scope="module")
def overflowing(tiny_simplified, tmp_path_factory):
    """A bare copy of the tiny fp16 UNet whose middle conv's weights are 60000: past fp16's range."""
    path = tmp_path_factory.mktemp("broken") / "unet.onnx"
    return path, plant_fp16_overflow(tiny_simplified, path)


def test_a_healthy_fp16_engine_has_no_divergent_layer(tiny_simplified):
    report = debug(tiny_simplified)
    assert report, report.first
    report.raise_for_status()
    print(f"{report.compared} tensors, largest error {report.largest_error:.3g}")
    assert report.compared > 300 and report.largest_error < 0.01 and report.backend == "onnxruntime"
    assert json.loads(json.dumps(report.to_json()))["passed"] is True


def test_a_planted_fp16_overflow_is_traced_to_its_layer(overflowing):
    path, planted = overflowing
    report = debug(Artifact.open(path))
    assert not report
    first = report.first
    assert first["node"] == planted.name and first["op"] == "Conv" and first["tensor"] == planted.output[0]
    assert first["finite"] is False, "the conv's own output is where inf first appears"
    with pytest.raises(ParityError, match=f"output of Conv node '{planted.name}', turns NaN/inf first"):
        report.raise_for_status()


def test_the_replica_is_the_same_graph_in_fp32(tiny_simplified):
    model = onnx.load(str(tiny_simplified.primary))
    replica = fp32_replica(model)
    assert [n.name for n in replica.graph.node] == [n.name for n in model.graph.node]
    assert not [t for t in replica.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert {i.type.tensor_type.elem_type for i in replica.graph.input} <= {onnx.TensorProto.FLOAT}


@pytest.fixture(scope="module")
def bf16_unet(tiny, store):
    """tiny's UNet as a bf16 TensorRT build parses it: exported in bf16 and simplified (bf16 weights, CastLike to
    them, Casts to bf16 around the Resize, Sin and Cos the simplify passes compute in fp32)."""
    return simplify.run(SimplifyConfig(), export.run(ExportConfig(precision="bf16"), tiny, store), store)


def elem_types(model: onnx.ModelProto) -> set[int]:
    """Every element type a graph names: weights, typed tensors, Cast targets, node attribute tensors."""
    graph = model.graph
    types = {t.data_type for t in graph.initializer}
    types |= {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
    for node in graph.node:
        types |= {a.i for a in node.attribute if node.op_type == "Cast" and a.name == "to"}
        types |= {a.t.data_type for a in node.attribute if a.type == onnx.AttributeProto.TENSOR}
    return types


def test_the_replica_of_a_bf16_graph_runs_on_onnxruntime_as_fp32(tiny, bf16_unet):
    """Review 4 B2: ONNX Runtime's CPU provider has no bf16 kernels, so the fp32 replica of a bf16 engine's graph must
    hold no bf16 at all. Fed debug's own bf16 inputs (torch: Polygraphy has bf16 only in its torch table), it computes
    what the bf16 weights compute in fp32: the UNet with its weights rounded to bf16, run in fp32."""
    import torch
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
    from polygraphy.comparator import Comparator

    from sdtrt.graph.onnx_graph import artifact_spec
    from sdtrt.sources.models import load_unet
    from sdtrt.tools.debug import _feeds

    model = onnx.load(str(bf16_unet.primary))
    assert onnx.TensorProto.BFLOAT16 in elem_types(model)
    replica = reference_graph(model)
    assert [n.name for n in replica.graph.node] == [n.name for n in model.graph.node]
    assert not elem_types(replica) & {onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16}

    spec = artifact_spec(bf16_unet)
    feeds = _feeds(spec, spec.default_profile(), 128, 128, seed=0)
    assert feeds["sample"].dtype == torch.bfloat16
    runner = OnnxrtRunner(SessionFromOnnx(replica.SerializeToString(), providers=["cpu"]))
    (_, [outputs]), *_ = Comparator.run([runner], data_loader=[feeds]).items()
    got = torch.as_tensor(np.asarray(outputs[spec.output_names[0]]))

    unet = load_unet(tiny).to(torch.bfloat16).float()  # bf16 weights, fp32 arithmetic
    with torch.no_grad():
        want = unet(*(feeds[name].float() for name in spec.input_names), return_dict=False)[0]
    error = float((got - want).abs().max() / want.abs().max())
    print(f"bf16 replica vs fp32 UNet with bf16 weights: normalised max error {error:.3g}")
    # Measured 7e-5 (ORT's fp32 kernels; constants the export rounded to bf16). bf16 arithmetic would be ~1e-2: an
    # ulp of bf16 is 2^-8.
    assert got.shape == want.shape and error < 1e-3


@pytest.mark.gpu
def test_debug_runs_on_a_bf16_tensorrt_engine(bf16_unet, store):
    """Review 4 B2 on a GPU: the engine gets debug's torch bf16 inputs, its bf16 tensors come back as torch ones and
    are compared as fp32 with the replica's."""
    import math

    from sdtrt.core.config import Range, ShapeProfile, TrtBuildConfig
    from sdtrt.tools.compile import build

    profile = ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384))
    engine, _ = build(bf16_unet, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(profile,)))
    report = debug(engine)
    assert report.backend == "tensorrt" and report.compared > 100 and math.isfinite(report.largest_error), report.worst


def test_a_bf16_graph_is_not_run_on_onnxruntime(bf16_unet):
    """Its engine's graph would not load there: said in one line naming what to debug instead."""
    with pytest.raises(WrongArtifactError, match=r"bf16 graph.*debug the TensorRT engine built from it"):
        debug(bf16_unet)


def fp8_level_4_graph() -> onnx.ModelProto:
    """A miniature of FP8 level 4's TensorRT graph in bf16: ModelOpt's ``trt::`` FP8 Q/DQ on the activation (its
    quantize output typed uint8, as ModelOpt's exporter types it), a standard FP8 Q/DQ pair with a float8e4m3fn zero
    point on the weight (convert_zp_fp8's), then MatMul and Add."""
    import ml_dtypes
    from onnx import TensorProto, helper

    def bf16(name: str, values: list[float] | np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(values, dtype=ml_dtypes.bfloat16), name)

    weight = np.linspace(-1, 1, 32).reshape(8, 4)
    initializers = [
        bf16("act_scale", np.array(0.02)), bf16("w_scale", np.array(1 / 448)), bf16("w", weight),
        bf16("bias", np.linspace(0, 1, 4)), helper.make_tensor("zp", TensorProto.FLOAT8E4M3FN, [], [0]),
    ]  # fmt: skip
    nodes = [
        helper.make_node("TRT_FP8QuantizeLinear", ["x", "act_scale"], ["x_q"], "x_quant", domain="trt"),
        helper.make_node("TRT_FP8DequantizeLinear", ["x_q", "act_scale"], ["x_dq"], "x_dequant", domain="trt"),
        helper.make_node("QuantizeLinear", ["w", "w_scale", "zp"], ["w_q"], "w_quant", saturate=1),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "zp"], ["w_dq"], "w_dequant"),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["mm"], "matmul"),
        helper.make_node("Add", ["mm", "bias"], ["y"], "add"),
    ]
    graph = helper.make_graph(
        nodes, "fp8_level_4", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 4])], initializers,
        value_info=[helper.make_tensor_value_info("x_q", TensorProto.UINT8, [2, 8])],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("trt", 1)])


def test_the_reference_of_an_fp8_level_4_graph_runs_on_onnxruntime():
    """Review 4 B3: only TensorRT's ONNX parser knows the trt:: domain; the reference is the replica with those ops
    as standard FP8 Q/DQ (qdq.standard_fp8_qdq), and computes FP8's rounding in fp32."""
    import ml_dtypes
    import onnxruntime as ort

    model = fp8_level_4_graph()
    reference = reference_graph(model)
    assert [n.name for n in reference.graph.node] == [n.name for n in model.graph.node]
    assert not [n for n in reference.graph.node if n.domain == "trt"]
    assert "trt" not in {o.domain for o in reference.opset_import}
    assert [n.domain for n in model.graph.node][:2] == ["trt", "trt"], (
        "the engine's graph is left as TensorRT parses it"
    )
    session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])

    x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)
    (got,) = session.run(None, {"x": x})

    def fp8(values: np.ndarray, scale: float) -> np.ndarray:  # saturating, as TensorRT (and saturate=1)
        return np.clip(values / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale

    weights = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    want = fp8(x, weights["act_scale"]) @ fp8(weights["w"], weights["w_scale"]) + weights["bias"]
    assert got.dtype == np.float32 and np.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)


def test_a_tensorrt_runners_torch_outputs_are_compared():
    """Fed torch tensors, Polygraphy's TrtRunner returns torch ones (backend/trt/runner.py, use_torch): bf16 ones are
    compared as fp32, FP8 ones skipped as ONNX Runtime's (uint8 bytes) are. Here the engine's outputs are the
    reference's own, rounded to bf16, and its FP8 tensors reinterpreted as torch's float8."""
    import torch
    from polygraphy import constants
    from polygraphy.backend.onnx import BytesFromOnnx, ModifyOutputs
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from sdtrt.tools.debug import _compare

    model = fp8_level_4_graph()
    graph = BytesFromOnnx(ModifyOutputs(reference_graph(model), outputs=constants.MARK_ALL))
    with OnnxrtRunner(SessionFromOnnx(graph, providers=["cpu"])) as runner:
        expected = runner.infer({"x": np.linspace(-3, 3, 16, dtype=np.float32).reshape(2, 8)})
    assert {expected[name].dtype for name in ("x_q", "w_q")} == {np.dtype(np.uint8)}
    got = {
        name: torch.from_numpy(value).view(torch.float8_e4m3fn) if value.dtype == np.uint8 else
        torch.from_numpy(value).to(torch.bfloat16)
        for name, value in expected.items()
    }  # fmt: skip
    report = _compare("engine", "tensorrt", model, got, expected, limit=0.05)
    assert report and report.compared == 4, report.worst  # x_dq, w_dq, mm, y
    assert 0 < report.largest_error < 2**-8, "bf16's rounding, relative to each tensor's largest value"


def test_the_q_dq_tensors_of_a_graph_are_no_tensorrt_outputs():
    """Polygraphy has fp8 in neither its torch nor its numpy dtype table, so it cannot view an FP8 network output, and
    a marked dequantize output would keep TensorRT from fusing the pair into its consumer's 8-bit kernel: the MARK_ALL
    network leaves the Q/DQ nodes' outputs (ModelOpt's trt:: ones and standard ones) unmarked. The network is a
    stand-in for TensorRT's INetworkDefinition, as Polygraphy's PostprocessNetwork passes it."""
    from types import SimpleNamespace

    from sdtrt.tools.debug import qdq_tensors, unmark_outputs

    quantized = qdq_tensors(fp8_level_4_graph())
    assert quantized == {"x_q", "x_dq", "w_q", "w_dq"}

    class Network:
        def __init__(self, names: list[str]) -> None:
            self.outputs = [SimpleNamespace(name=name) for name in names]

        @property
        def num_outputs(self) -> int:
            return len(self.outputs)

        def get_output(self, index: int) -> SimpleNamespace:
            return self.outputs[index]

        def unmark_output(self, tensor: SimpleNamespace) -> None:
            self.outputs.remove(tensor)

    network = Network(["x_q", "x_dq", "w_q", "w_dq", "mm", "y"])
    unmark_outputs(network, quantized)
    assert [t.name for t in network.outputs] == ["mm", "y"]


@pytest.mark.parametrize(
    ("height", "problem"),
    [
        # The report's 1024 was OOM-killed at 20 GB on the original code; 416 is past the profile as surely.
        ("416", "height 416 is outside the engine's profile (128..384 px)"),
        ("100", "height 100 is not a positive multiple of 16 pixels"),
        ("7", "height 7 is not a positive multiple of 16 pixels"),
    ],
)
def test_a_size_generate_would_refuse_is_refused_before_anything_runs(tiny_set, store, height, problem):
    """Newcomer 4, crash 1: debug applies generate's size rule to an engine and to a set, exit 2 in one line."""
    from sdtrt.pipeline.loading import engine_members

    for engine in (engine_members(tiny_set)["unet"].path, tiny_set.path):
        result = run_cli("debug", str(engine), "--height", height, "--engines", str(store.root))
        assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
        assert problem in result.stderr and "tensors compared" not in result.stdout


def test_cli_exit_codes_and_one_line_errors(overflowing, tiny, tiny_simplified, tmp_path, store):
    path, planted = overflowing
    broken = run_cli("debug", str(path), "--json", str(tmp_path / "d.json"))
    assert broken.returncode == 3 and broken.stderr.strip().splitlines()[-1].startswith("error: ")
    assert planted.name in broken.stderr and planted.output[0] in broken.stdout
    assert json.loads((tmp_path / "d.json").read_text())["first"]["node"] == planted.name
    healthy = run_cli("debug", f"simplify/{tiny_simplified.key[:10]}", "--engines", str(store.root), check=True)
    assert last_line(healthy.stdout) == "no layer diverges past 0.05"
    other = tmp_path / "other"
    other.mkdir()
    vae = export.run(ExportConfig(component="vae_decoder", precision="fp32"), tiny, store)
    shutil.copy(vae.primary, other / "graph.onnx")  # without its manifest: not recognisably anything
    bare = run_cli("debug", str(other / "graph.onnx"))
    assert bare.returncode == 1 and bare.stderr.strip().count("\n") == 0
    assert "does not look like an SD UNet graph" in bare.stderr


def test_a_set_is_debugged_member_by_member(tiny_set, store, tmp_path):
    result = run_cli("debug", str(tiny_set.path), "--json", str(tmp_path / "d.json"), check=True)
    members = tiny_set.manifest["members"]
    for component in members:
        assert f"{component}: " in result.stdout and "tensors compared on onnxruntime" in result.stdout
    assert set(json.loads((tmp_path / "d.json").read_text())) == set(members)
    assert last_line(result.stdout) == "no layer diverges past 0.05"


@pytest.mark.parametrize(("command", "wanted"), [("simplify", "export"), ("build", "simplify"), ("wrap", "build-trt")])
def test_single_graph_commands_given_a_set_name_its_members(tiny_set, store, command, wanted):
    result = run_cli(command, str(tiny_set.path), "--engines", str(store.root))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{command} takes one graph, and {tiny_set.path} is an engine set" in result.stderr
    assert "manifest.json" not in result.stderr and "re-export" not in result.stderr
    if wanted != "build-trt":  # an ONNX Runtime set holds no TensorRT plans
        assert (
            f"unet: {store.root / wanted}" in result.stderr and f"vae_decoder: {store.root / wanted}" in result.stderr
        )


def test_a_non_graph_artifact_is_named_by_its_stage(tiny, tiny_set, store):
    from sdtrt.pipeline.loading import engine_members
    from sdtrt.stages import weight_map

    weight_map.for_engine(engine_members(tiny_set)["unet"], tiny)
    made = next(a for a in store.artifacts() if a.stage == "weight-map")
    result = run_cli("build", str(made.path), "--engines", str(store.root))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{made.path} is a 'weight-map' artifact; pass the simplify artifact a stage printed" in result.stderr


@pytest.fixture(scope="module")
def transformer_graphs(store):
    """SD3's fp16 transformer and Flux's T5 (fp32, as T5 is built by default), exported alone."""
    from sdtrt.sources.models import resolve_model

    sd3, flux = resolve_model("tiny-sd3"), resolve_model("tiny-flux")
    return {
        "sd3 transformer": export.run(ExportConfig(component="transformer", precision="fp16"), sd3, store),
        "flux t5": export.run(ExportConfig(component="text_encoder_2"), flux, store),
    }


@pytest.mark.parametrize("graph", ["sd3 transformer", "flux t5"])
def test_transformer_and_t5_graphs_are_debugged(transformer_graphs, graph):
    report = debug(transformer_graphs[graph])
    print(f"{graph}: {report.compared} tensors, largest error {report.largest_error:.3g}")
    # T5's position buckets take log(0) = -inf in fp32 as well: the graph's own, not a divergence.
    assert report and report.compared > 50 and report.largest_error < 0.01, report.first


def test_cache_ls_names_the_transformer_families(transformer_graphs, store):
    listed = run_cli("cache", "ls", "--engines", str(store.root), check=True).stdout.splitlines()
    for artifact, component, family in [
        (transformer_graphs["sd3 transformer"], "transformer", "sd3"),
        (transformer_graphs["flux t5"], "text_encoder_2", "flux"),
    ]:
        row = next(line.split() for line in listed if str(artifact.path) in line)
        assert row[2:4] == [component, family], row
