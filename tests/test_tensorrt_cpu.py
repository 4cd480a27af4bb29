"""Everything about the TensorRT target that does not need a GPU: profiles, keys, refusals."""

from __future__ import annotations

import pytest
import torch

from sdtrt.compile import resolve_target
from sdtrt.config import Range, ShapeProfile, TrtBuildConfig
from sdtrt.errors import ArtifactError, ConfigError, MissingDependencyError
from sdtrt.gpu import engine_mismatch, tensorrt_missing
from sdtrt.runtime.tensorrt import describe_profiles, select_profile
from sdtrt.stages import build_trt, wrap
from sdtrt.store import StageRequest

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_worker_request_has_cfg_doubled_latent_profiles(tiny_simplified, tmp_path):
    config = TrtBuildConfig(profiles=(ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384)),))
    request = build_trt.worker_request(config, tiny_simplified, tmp_path)
    assert request["onnx"] == str(tiny_simplified.primary) and request["optimization_level"] == 3
    (profile,) = request["profiles"]
    assert profile["sample"] == [[2, 4, 16, 16], [2, 4, 32, 32], [4, 4, 48, 48]]
    assert profile["timestep"] == [[2], [2], [4]]
    assert profile["encoder_hidden_states"] == [[2, 77, 32], [2, 77, 32], [4, 77, 32]]


def test_static_shapes_pin_every_profile_to_its_optimum(tiny_simplified, tmp_path):
    config = TrtBuildConfig(profiles=(ShapeProfile.around(256, 16),), static_shapes=True)
    (profile,) = build_trt.worker_request(config, tiny_simplified, tmp_path)["profiles"]
    assert profile["sample"] == [[2, 4, 32, 32]] * 3


def test_build_settings_are_checked():
    with pytest.raises(ConfigError, match=r"0\.\.5"):
        TrtBuildConfig(optimization_level=7)
    with pytest.raises(ConfigError, match="at least one"):
        TrtBuildConfig(profiles=())


def test_engine_key_depends_on_gpu_and_tensorrt_but_not_the_timing_cache():
    def key(env: dict, **config) -> str:
        return StageRequest("build-trt", 1, TrtBuildConfig(**config), [{"digest": "x"}], env).key

    l4 = {"tensorrt": "10.13.0", "gpu": "NVIDIA L4", "compute_capability": "8.9"}
    h100 = l4 | {"gpu": "NVIDIA H100", "compute_capability": "9.0"}
    assert key(l4) != key(h100)
    assert key(l4) != key(l4 | {"tensorrt": "10.14.1"})
    assert key(l4) == key(l4, timing_cache="/tmp/cache.bin")
    assert key(l4) != key(l4, static_shapes=True)


def test_engine_mismatch_says_what_differs():
    built = {"tensorrt": "10.13.0", "gpu": "NVIDIA L4", "compute_capability": "8.9"}
    assert engine_mismatch(built, dict(built)) is None
    message = engine_mismatch(built, {"tensorrt": "10.14.1", "gpu": "NVIDIA H100", "compute_capability": "9.0"})
    assert "TensorRT 10.13.0 (this machine: 10.14.1)" in message
    assert "compute capability 8.9 on NVIDIA L4 (this machine: 9.0 on NVIDIA H100)" in message


def test_profile_selection_takes_the_first_that_covers():
    small = {"sample": ((2, 4, 32, 32), (2, 4, 64, 64), (2, 4, 64, 64))}
    large = {"sample": ((2, 4, 64, 64), (8, 4, 96, 96), (8, 4, 128, 128))}
    assert select_profile([small, large], {"sample": (2, 4, 64, 64)}) == 0
    assert select_profile([small, large], {"sample": (4, 4, 96, 128)}) == 1
    assert select_profile([small, large], {"sample": (2, 4, 160, 64)}) is None
    assert "profile 1: (2, 4, 64, 64) .. (8, 4, 128, 128)" in describe_profiles([small, large], "sample")


@needs_no_gpu
def test_no_gpu_paths_fail_fast_with_the_container_hint(tiny_simplified, tiny_engine, store):
    assert tensorrt_missing() == "no CUDA GPU is visible to torch"
    with pytest.raises(MissingDependencyError, match="make docker-build"):
        resolve_target("tensorrt")
    with pytest.raises(MissingDependencyError, match="no CUDA GPU"):
        build_trt.run(TrtBuildConfig(), tiny_simplified, store)
    with pytest.raises(ArtifactError, match="wrap takes a TensorRT engine"):
        wrap.run(wrap.WrapConfig(), tiny_engine, store)
    assert resolve_target("auto")[0] == "onnxruntime"
