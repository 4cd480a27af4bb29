"""Simplify: fewer nodes, same outputs, and a fallback that is recorded when onnxsim fails."""

from __future__ import annotations

import pytest

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import SimplifyConfig
from sdtrt.core.errors import ArtifactError, SimplifyError
from sdtrt.core.store import Store
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import load_unet
from sdtrt.spec import ValidationCase
from sdtrt.stages import simplify
from sdtrt.tools.validate import compare_case


def test_onnxsim_reduces_nodes_and_output_still_matches(tiny, tiny_simplified):
    details = tiny_simplified.manifest["details"]
    assert details["method"] == "onnxsim"
    assert details["fallback_reason"] is None
    assert details["nodes_after"] < details["nodes_before"]
    assert details["check"]["cosine"] > 0.9999
    runtime = open_runtime(tiny_simplified)
    stats = compare_case(runtime, load_unet(tiny), runtime.spec, ValidationCase(2, 256, 256))
    assert stats["cosine"] >= 0.999


def test_fold_method(tiny_export, store):
    folded = simplify.run(SimplifyConfig(method="fold"), tiny_export, store)
    details = folded.manifest["details"]
    assert details["method"] == "fold"
    assert details["nodes_after"] < details["nodes_before"]
    assert details["check"]["max_abs"] < 1e-3


def test_falls_back_to_folding_when_onnxsim_fails(tiny_export, tmp_path, monkeypatch):
    import onnxsim

    def broken(*args, **kwargs):
        raise MemoryError("simulated: model too large for onnxsim")

    monkeypatch.setattr(onnxsim, "simplify", broken)
    result = simplify.run(SimplifyConfig(), tiny_export, Store(tmp_path))
    details = result.manifest["details"]
    assert details["method"] == "fold"
    assert "MemoryError" in details["fallback_reason"]
    assert details["check"]["cosine"] > 0.9999
    with pytest.raises(SimplifyError, match="retry with --method fold"):
        simplify.run(SimplifyConfig(method="onnxsim"), tiny_export, Store(tmp_path / "strict"))


def test_corrupt_onnx_is_refused_and_nothing_is_stored(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07not a protobuf at all")
    store = Store(tmp_path / "engines")
    with pytest.raises(ArtifactError, match="not a readable ONNX model"):
        simplify.run(SimplifyConfig(), Artifact.open(bad), store)
    assert store.artifacts() == []


def test_op_table_rows_end_with_total():
    rows = simplify.op_table_rows({"Add": 3, "Identity": 2}, {"Add": 1})
    assert rows == [("Add", 3, 1), ("Identity", 2, 0), ("Total", 5, 1)]
