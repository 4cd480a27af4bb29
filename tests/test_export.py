"""Export: IO contract, checker, and numerical parity with the fp32 PyTorch UNet on ONNX Runtime."""

from __future__ import annotations

import onnx
import pytest

from sdtrt.core.config import ExportConfig
from sdtrt.graph import onnx_graph
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import load_unet
from sdtrt.spec import ValidationCase
from sdtrt.stages import export
from sdtrt.tools.validate import compare_case

# Three batch/resolution combinations inside the tiny model's default profile (pixels, CFG batch).
PROFILE_CASES = [
    ValidationCase(2, 256, 256, 981.0, 0), ValidationCase(4, 128, 384, 500.0, 1), ValidationCase(8, 384, 192, 1.0, 2)
]  # fmt: skip


@pytest.fixture(scope="module")
def reference_unet(tiny):
    return load_unet(tiny)


def test_fp16_export_io_contract(tiny_export):
    path = tiny_export.primary
    onnx_graph.check(path)
    inputs, outputs = onnx_graph.graph_io(path)
    assert [(t.name, t.dtype, t.shape) for t in inputs] == [
        ("sample", "float16", ("batch", 4, "height", "width")),
        ("timestep", "float32", ("batch",)),
        ("encoder_hidden_states", "float16", ("batch", 77, 32)),
    ]
    assert [(t.name, t.dtype, t.shape) for t in outputs] == [("out_sample", "float16", ("batch", 4, "height", "width"))]
    manifest = tiny_export.manifest
    # The fp16 UNet exports through TorchScript: its patches are in effect too.
    assert manifest["patches"] == [
        "broadcast_to->expand",
        "concat->cat",
        "rms_norm->arithmetic",
        "flux rotary: unflatten",
        "nearest-exact xN->nearest",
    ]
    assert manifest["config"]["precision"] == "fp16"
    assert not onnx_graph.data_file(path).exists()


@pytest.mark.parametrize("case", PROFILE_CASES, ids=lambda c: f"b{c.batch}-{c.height}x{c.width}")
def test_fp16_export_matches_pytorch_fp32(tiny_export, reference_unet, case):
    runtime = open_runtime(tiny_export)
    stats = compare_case(runtime, reference_unet, runtime.spec, case)
    print(f"fp16 {stats['case']}: max abs {stats['max_abs']:.3g}, cosine {stats['cosine']:.7f}")
    assert stats["finite"]
    assert stats["cosine"] >= 0.999
    assert stats["max_abs"] < 0.05


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_fp32_export_matches_pytorch_closely(tiny, loaded_store, reference_unet, exporter):
    # Loaded: the graph test_export_streamed compares the streamed one with (a cache hit for whichever runs second).
    artifact = export.run(ExportConfig(precision="fp32", exporter=exporter, weights="load"), tiny, loaded_store)
    inputs, _ = onnx_graph.graph_io(artifact.primary)
    assert inputs[0].shape == ("batch", 4, "height", "width"), "dynamo's axis names are normalised"
    runtime = open_runtime(artifact)
    stats = compare_case(runtime, reference_unet, runtime.spec, PROFILE_CASES[1])
    assert stats["max_abs"] < 1e-4
    assert stats["cosine"] > 0.99999


def test_indexed_io_names_for_torchtrtc(tiny, store):
    artifact = export.run(ExportConfig(io_naming="indexed"), tiny, store)
    inputs, outputs = onnx_graph.graph_io(artifact.primary)
    assert [t.name for t in inputs] == ["input_0", "input_1", "input_2"]
    assert [t.name for t in outputs] == ["output_0"]
    assert artifact.key != export.run(ExportConfig(), tiny, store).key


def test_large_models_use_one_external_data_file(tiny, tmp_path, monkeypatch):
    """Over the threshold (2 GB in real use) weights go to unet.onnx.data, and checks still pass."""
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.core.store import Store
    from sdtrt.stages import simplify

    monkeypatch.setattr(onnx_graph, "EXTERNAL_DATA_THRESHOLD", 100_000)
    store = Store(tmp_path)
    exported = export.run(ExportConfig(), tiny, store)
    data = onnx_graph.data_file(exported.primary)
    assert data.is_file() and data.stat().st_size > 1_000_000
    assert sorted(f["name"] for f in exported.manifest["files"]) == ["unet.onnx", "unet.onnx.data"]
    graph = onnx.load(str(exported.primary), load_external_data=False)
    locations = {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"unet.onnx.data"}
    simplified = simplify.run(SimplifyConfig(), exported, store)
    assert onnx_graph.data_file(simplified.primary).is_file()
    assert simplified.manifest["details"]["check"]["cosine"] > 0.9999
