"""Serving checks that need no running server: the Triton model's start on a GPU instance, deploy's budget, serve's
ports, the client's message when nothing listens. tests/test_serve.py serves for real."""

from __future__ import annotations

import socket
import sys
import time
import types

import pytest

from sdtrt.pipeline.request import GenerateRequest

from .helpers import run_cli


class Loaded(Exception):
    """Raised by the stand-in load_pipeline: initialize stops where the engines would open."""


def test_a_gpu_instance_selects_its_device_before_any_engine_opens_and_loads_with_the_budget(
    tiny_set, tmp_path, monkeypatch
):
    import torch

    import sdtrt.pipeline.loading
    import sdtrt.runtime
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
    from sdtrt.serving.triton_model import TritonPythonModel

    monkeypatch.setattr(sdtrt.runtime, "streams_weights", lambda artifact: True)  # no TensorRT plan builds here
    deployment = deploy_triton(tiny_set, tmp_path, TritonDeployConfig(weight_budget="50%"))
    assert deployment.record["config"]["weight_budget"] == "50%" and deployment.weight_budget == "50%"

    order: list[tuple[str, object]] = []

    def load_pipeline(source, engine, **kwargs):
        order.append(("load_pipeline", kwargs.get("weight_budget")))
        raise Loaded

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: order.append(("set_device", device)))
    monkeypatch.setattr(sdtrt.pipeline.loading, "load_pipeline", load_pipeline)
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


def test_serve_refuses_a_port_in_use_before_starting_triton(tmp_path):
    from sdtrt.serving.serve import free_ports

    model = tmp_path / "repo" / "stable_diffusion"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\n')
    (model / "sdtrt.json").write_text("{}\n")
    grpc, metrics = free_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.monotonic()
        serve = run_cli("serve", str(tmp_path / "repo"), "--http-port", str(port), "--grpc-port", str(grpc),
                        "--metrics-port", str(metrics), timeout=120)  # fmt: skip
        took = time.monotonic() - started
    assert serve.returncode == 2, serve.stderr
    assert serve.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 cannot be bound (Address already in use); pass another --http-port"
    ]
    assert took < 30, f"refused after {took:.0f} s: Triton was started"  # the CLI's own start is most of it


def test_serve_refuses_one_port_for_two_endpoints_and_a_host_that_is_no_address():
    from sdtrt.core.errors import ServeAddressError
    from sdtrt.serving.serve import ServeConfig, check_ports, free_ports

    http, grpc = free_ports(2)
    with pytest.raises(ServeAddressError, match=f"^--metrics-port {http} is also --http-port: give each its own port$"):
        check_ports(ServeConfig(http_port=http, grpc_port=grpc, metrics_port=http))
    with pytest.raises(ServeAddressError, match=r"^--host nowhere\.invalid is not an address \("):
        check_ports(ServeConfig(host="nowhere.invalid"))
    with pytest.raises(ServeAddressError, match=r"^--host 192\.0\.2\.1 is not an address of this machine \("):
        check_ports(ServeConfig(host="192.0.2.1", http_port=http, grpc_port=grpc, metrics_port=free_ports(1)[0]))


def test_a_server_that_fails_to_start_is_quoted_not_said_to_be_silent():
    from sdtrt.serving.serve import _failure

    line = (
        'E1125 21:04:05.123456 4242 main.cc:245] "failed to start HTTP service: Unavailable - Socket '
        "'127.0.0.1:18100' already in use \""
    )
    assert _failure([line]) == "failed to start HTTP service: Unavailable - Socket '127.0.0.1:18100' already in use"


def test_client_says_it_cannot_reach_a_server_that_never_answered():
    from sdtrt.core.errors import ServeError
    from sdtrt.serving.client import remote_image
    from sdtrt.serving.serve import free_ports

    (port,) = free_ports(1)  # nothing listens there
    with pytest.raises(ServeError, match=rf"^cannot reach Triton at 127\.0\.0\.1:{port}: .*Connection refused"):
        remote_image(f"127.0.0.1:{port}", GenerateRequest(prompt="a fox"))


def test_client_refuses_an_image_that_is_not_a_pil_image_in_one_line():
    import numpy as np

    from sdtrt.core.errors import RequestError
    from sdtrt.serving.client import request_inputs

    with pytest.raises(RequestError, match=r"^the Triton client sends image as one PIL image, not a ndarray: open it"):
        request_inputs(GenerateRequest(prompt="a fox", image=np.zeros((64, 64, 3), dtype=np.uint8)))
