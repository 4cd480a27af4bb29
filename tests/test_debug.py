"""`sdtrt debug`: real ONNX Runtime runs of an engine and its fp32 replica, every tensor an output (Polygraphy)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from sdtrt.config import ExportConfig
from sdtrt.debug import debug, fp32_replica
from sdtrt.errors import ParityError
from sdtrt.stages import export
from sdtrt.store import Artifact

from .helpers import last_line, run_cli


@pytest.fixture(scope="module")
def overflowing(tiny_simplified, tmp_path_factory):
    """A bare copy of the tiny fp16 UNet whose middle conv's weights are 60000: past fp16's range."""
    model = onnx.load(str(tiny_simplified.primary))
    weights = {t.name: t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16}
    convs = [n for n in model.graph.node if n.op_type == "Conv" and n.input[1] in weights]
    planted = convs[len(convs) // 2]
    tensor = weights[planted.input[1]]
    tensor.CopyFrom(numpy_helper.from_array(np.full_like(numpy_helper.to_array(tensor), 60000.0), tensor.name))
    path = tmp_path_factory.mktemp("broken") / "unet.onnx"
    onnx.save(model, str(path))
    return path, planted


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
    from sdtrt.pipeline import engine_members

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
    from sdtrt.pipeline import engine_members
    from sdtrt.stages import weight_map

    weight_map.for_engine(engine_members(tiny_set)["unet"], tiny)
    made = next(a for a in store.artifacts() if a.stage == "weight-map")
    result = run_cli("build", str(made.path), "--engines", str(store.root))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert f"{made.path} is a 'weight-map' artifact; pass the simplify artifact a stage printed" in result.stderr


@pytest.fixture(scope="module")
def transformer_graphs(store):
    """SD3's fp16 transformer and Flux's T5 (fp32, as T5 is built by default), exported alone."""
    from sdtrt.models import resolve_model

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
