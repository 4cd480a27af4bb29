"""Serving checks that need no running server: the Triton model's start on a GPU instance, deploy's budget.
tests/test_serve.py serves for real."""

from __future__ import annotations

import sys
import types

import pytest

from .helpers import run_cli


class Loaded(Exception):
    """Raised by the stand-in load_pipeline: initialize stops where the engines would open."""


def test_a_gpu_instance_selects_its_device_before_any_engine_opens_and_loads_with_the_budget(
    tiny_set, tmp_path, monkeypatch
):
    import torch

    import sdtrt.pipeline
    import sdtrt.runtime
    from sdtrt.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.triton_model import TritonPythonModel

    monkeypatch.setattr(sdtrt.runtime, "streams_weights", lambda artifact: True)  # no TensorRT plan builds here
    deployment = deploy_triton(tiny_set, tmp_path, TritonDeployConfig(weight_budget="50%"))
    assert deployment.record["config"]["weight_budget"] == "50%" and deployment.weight_budget == "50%"

    order: list[tuple[str, object]] = []

    def load_pipeline(source, engine, **kwargs):
        order.append(("load_pipeline", kwargs.get("weight_budget")))
        raise Loaded

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: order.append(("set_device", device)))
    monkeypatch.setattr(sdtrt.pipeline, "load_pipeline", load_pipeline)
    logger = types.SimpleNamespace(log_warn=print)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(Logger=logger))
    args = {"model_repository": str(deployment.folder), "model_name": "stable_diffusion", "model_version": "1",
            "model_instance_kind": "GPU", "model_instance_device_id": "1"}  # fmt: skip
    with pytest.raises(Loaded):
        TritonPythonModel().initialize(args)
    assert order == [("set_device", 1), ("load_pipeline", "50%")]


def test_deploy_refuses_a_budget_for_a_set_that_does_not_stream(tiny_set, tmp_path):
    refused = run_cli("deploy", "triton", "--engine", str(tiny_set.path), "--out", str(tmp_path / "repo"),
                      "--weight-streaming-budget", "50%", timeout=300)  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: a weight streaming budget (50%) applies to TensorRT engines built with --weight-streaming, and none "
        "of these was: rebuild with `sdtrt compile --target tensorrt --weight-streaming`, or leave the budget out"
    ]
    assert not (tmp_path / "repo").exists(), "refused before anything is written"
