"""TensorRT build and runtime rules that need no GPU (review 4: S1, S3, W1, M2, S2)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sdtrt.core.config import ExportConfig, TrtBuildConfig


@dataclass
class _Stub:
    """Stands in for an artifact: what the stage stub was given."""

    config: Any


def _compiled_trt_configs(monkeypatch, tiny, store, precision: str, trt_config: TrtBuildConfig | None):
    """The (graph precision, TrtBuildConfig) compile hands the TensorRT build of each member, every stage stubbed."""
    from sdtrt.stages import build_trt, engine_set, export, simplify
    from sdtrt.tools import compile as compile_module

    built: dict[str, tuple[str, TrtBuildConfig]] = {}

    def build(source, store, target, profile, trt_config=None):
        built[source.config.component] = (source.config.precision, trt_config)
        return source, ""

    monkeypatch.setattr(compile_module, "resolve_target", lambda target: ("tensorrt", "stubbed"))
    monkeypatch.setattr(build_trt, "gpu_environment", lambda: {"gpu": "an Ampere GPU", "compute_capability": "8.6"})
    monkeypatch.setattr(compile_module, "torch_tensorrt_missing", lambda: "no torch-tensorrt here")
    monkeypatch.setattr(compile_module, "build", build)
    monkeypatch.setattr(export, "run", lambda config, model, store: _Stub(config))
    monkeypatch.setattr(simplify, "run", lambda config, exported, store: exported)
    monkeypatch.setattr(engine_set, "run", lambda *args: _Stub(None))
    compile_module.compile_model(tiny, store, "tensorrt", ExportConfig(precision=precision), trt_config=trt_config)
    return built


def test_a_vae_upcast_for_range_keeps_tf32_and_an_asked_fp32_clears_it(tiny, store, monkeypatch):
    """S1: in an fp16 compile the VAE is exported fp32 for range (force_upcast), and builds with TF32 on, as NVIDIA's
    demo builds its fp32 SDXL VAE; with --precision fp32 every member computes in fp32 (TF32 off, in the key)."""
    from sdtrt.core.config import cache_key

    def resolved(member: tuple[str, TrtBuildConfig]) -> TrtBuildConfig:  # as build_trt.resolved does
        precision, config = member
        return replace(config, tf32=config.tf32_for(precision))

    fp16 = _compiled_trt_configs(monkeypatch, tiny, store, "fp16", None)
    assert fp16["vae_decoder"][0] == "fp32" and resolved(fp16["vae_decoder"]).tf32 is True
    assert resolved(fp16["unet"]).tf32 is True
    fp32 = _compiled_trt_configs(monkeypatch, tiny, store, "fp32", TrtBuildConfig())
    assert fp32["vae_decoder"][0] == "fp32" and resolved(fp32["vae_decoder"]).tf32 is False
    # the key tells the two VAE plans apart (TF32 is keyed when off)
    assert "tf32" not in cache_key(resolved(fp16["vae_decoder"]))
    assert cache_key(resolved(fp32["vae_decoder"]))["tf32"] is False
    # --no-tf32 wins over the upcast, --tf32 over the asked fp32
    assert (
        _compiled_trt_configs(monkeypatch, tiny, store, "fp16", TrtBuildConfig(tf32=False))["vae_decoder"][1].tf32
        is False
    )
    assert (
        _compiled_trt_configs(monkeypatch, tiny, store, "fp32", TrtBuildConfig(tf32=True))["vae_decoder"][1].tf32
        is True
    )


def test_refittable_builds_are_refused_on_tensorrt_11_3_before_any_work(tiny, tiny_simplified, store, monkeypatch):
    """W1: TensorRT 11.3's refit page says kREFIT may drop GEMM biases with no refit at all; REFIT_IDENTICAL is
    unaffected, so only --refittable is refused, before export (compile) or the worker (build)."""
    import pytest

    from sdtrt.core import gpu
    from sdtrt.core.errors import MissingDependencyError
    from sdtrt.core.gpu import refit_problem
    from sdtrt.stages import build_trt, export
    from sdtrt.tools import compile as compile_module

    assert "GEMM biases" in refit_problem("11.3.0.1") and "without --refittable" in refit_problem("11.3")
    assert (
        refit_problem("11.4.0.7") is None and refit_problem("10.13.0.35") is None and refit_problem("11.30.1") is None
    )
    monkeypatch.setattr(gpu, "tensorrt_version", lambda: "11.3.0.1")
    monkeypatch.setattr(build_trt, "require_tensorrt", lambda: None)
    with pytest.raises(MissingDependencyError, match=r"TensorRT 11\.3\.0\.1 may drop GEMM biases"):
        build_trt.run(TrtBuildConfig(refittable=True), tiny_simplified, store)
    monkeypatch.setattr(compile_module, "resolve_target", lambda target: ("tensorrt", "stubbed"))
    monkeypatch.setattr(build_trt, "gpu_environment", lambda: {"gpu": "an Ampere GPU", "compute_capability": "8.6"})
    monkeypatch.setattr(export, "run", lambda *args: pytest.fail("exported before the refusal"))
    with pytest.raises(MissingDependencyError, match="another TensorRT version, or without --refittable"):
        compile_module.compile_model(tiny, store, "tensorrt", trt_config=TrtBuildConfig(refittable=True))


def test_a_torch_tensorrt_without_its_torchscript_frontend_is_missing_for_wrapping(monkeypatch):
    """M7 (review 3 item 12): a torch-tensorrt wheel without libtorchtrt.so imports, but has no TorchScript
    frontend (pytorch/TensorRT _features.py ENABLED_FEATURES.torchscript_frontend), which wrapping needs."""
    import sys
    import types
    from collections import namedtuple

    from sdtrt.core import gpu

    features = namedtuple("FeatureSet", ["torchscript_frontend", "torch_tensorrt_runtime"])
    module = types.ModuleType("torch_tensorrt._features")
    monkeypatch.setitem(sys.modules, "torch_tensorrt", types.ModuleType("torch_tensorrt"))
    monkeypatch.setitem(sys.modules, "torch_tensorrt._features", module)
    monkeypatch.setattr(gpu, "tensorrt_missing", lambda: None)
    monkeypatch.setattr(gpu, "_installed", lambda name: True)
    module.ENABLED_FEATURES = features(False, True)  # type: ignore[attr-defined]
    assert "without its TorchScript frontend" in gpu.torch_tensorrt_missing()
    module.ENABLED_FEATURES = features(True, True)  # type: ignore[attr-defined]
    assert gpu.torch_tensorrt_missing() is None


def test_a_size_budget_is_documented_per_streaming_engine():
    """M3: every streaming member of a set takes the whole budget (pipeline.standins passes one WeightBudget to
    each), so the option and the docs say "per engine" rather than leave a set-wide reading open."""
    from pathlib import Path
    from typing import get_args

    from sdtrt.cli.request_options import WeightBudgetOpt

    (option,) = get_args(WeightBudgetOpt)[1:]
    assert "each streaming engine" in option.help and "not shared across a set" in option.help
    page = " ".join((Path(__file__).parents[1] / "docs" / "guide" / "tensorrt.md").read_text().split())
    assert "per streaming engine, not for the set" in page


def test_a_pipelines_plans_share_one_buffer_sized_for_the_largest(monkeypatch):
    """S2: two or more TensorRT plans of a pipeline share one activation buffer of the largest member's size (as
    NVIDIA's demo does); fewer, or wrapped engines (their own contexts), keep TensorRT's default. A member that needs
    more after the buffer was made replaces it, once the device is idle, and bumps the generation that makes every
    context rebind and re-capture its CUDA graph."""
    from types import SimpleNamespace

    import torch

    from sdtrt.runtime.device_memory import SharedDeviceMemory, shared_for

    def members(*stages: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(stage=stage) for stage in stages]

    cpu = torch.device("cpu")
    assert shared_for(members("build-trt"), cpu) is None
    assert shared_for(members("build-trt", "wrap", "build-ort"), cpu) is None
    shared = shared_for(members("build-trt", "build-trt", "wrap"), cpu)
    assert isinstance(shared, SharedDeviceMemory)

    synced: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    for size in (3000, 12000, 500):  # text encoder, UNet, VAE decoder
        shared.reserve(size)
    first = shared.buffer()
    assert first.numel() == 12000 and shared.generation == 1 and shared.buffer() is first and not synced
    shared.reserve(8000)  # fits: the same buffer, nothing to rebind
    assert shared.buffer() is first and shared.generation == 1
    shared.reserve(20000)  # a member opened later that needs more
    assert shared.buffer().numel() == 20000 and shared.generation == 2 and synced == [cpu]
