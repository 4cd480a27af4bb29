"""Everything about the TensorRT target that does not need a GPU: profiles, keys, refusals."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sdtrt.core.config import Range, ShapeProfile, TrtBuildConfig
from sdtrt.core.errors import ArtifactError, ConfigError, MissingDependencyError
from sdtrt.core.gpu import engine_mismatch, tensorrt_missing
from sdtrt.core.stage_request import StageRequest
from sdtrt.runtime.trt_engine_io import describe_profiles, select_profile
from sdtrt.runtime.trt_refill import graph_digest, refill_graph
from sdtrt.stages import build_trt, wrap
from sdtrt.tools.compile import resolve_target

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


def test_worker_request_has_cfg_doubled_latent_profiles(tiny_simplified, tmp_path):
    """The UNet batch doubles with guidance, except at the minimum: guidance off (Turbo, LCM) runs one per image."""
    config = TrtBuildConfig(profiles=(ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384)),))
    request = build_trt.worker_request(config, tiny_simplified, tmp_path)
    assert request["onnx"] == str(tiny_simplified.primary) and request["optimization_level"] == 3
    (profile,) = request["profiles"]
    assert profile["sample"] == [[1, 4, 16, 16], [2, 4, 32, 32], [4, 4, 48, 48]]
    assert profile["timestep"] == [[1], [2], [4]]
    assert profile["encoder_hidden_states"] == [[1, 77, 32], [2, 77, 32], [4, 77, 32]]


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


# ---- issue 9: the logic of the TensorRT fixes, where it can run without a GPU -----------------------------------


def test_wrapped_module_results_are_named_in_binding_order(tiny):
    from sdtrt.runtime.torchscript import named_outputs
    from sdtrt.spec import component_spec

    out = torch.ones(2)
    assert named_outputs(component_spec(tiny, "unet"), out) == {"out_sample": out}, "one output: the tensor itself"
    text = component_spec(tiny, "text_encoder")
    outs = (torch.ones(1), torch.ones(2), torch.ones(3))  # several outputs: a tuple
    assert named_outputs(text, outs) == dict(zip(text.output_names, outs, strict=True))
    with pytest.raises(ValueError):
        named_outputs(text, outs[:2])


def test_misaligned_tensors_are_copied_before_tensorrt_sees_them():
    from sdtrt.core.errors import EngineInputError
    from sdtrt.runtime.tensorrt import TENSOR_ALIGNMENT, aligned, require

    base = torch.zeros(1024, dtype=torch.float16)
    start = next(i for i in range(TENSOR_ALIGNMENT) if base[i:].data_ptr() % TENSOR_ALIGNMENT)
    view = base[start:]
    copy = aligned(view)
    assert copy.data_ptr() != view.data_ptr() and torch.equal(copy, view)
    whole = torch.zeros(8)
    if whole.data_ptr() % TENSOR_ALIGNMENT == 0:
        assert aligned(whole) is whole
    with pytest.raises(EngineInputError, match="TensorRT refused to bind input 'sample'"):
        require(False, "bind input 'sample'")


class StandInCache:
    """trt.ITimingCache as pyCoreDoc.h documents it: combine adds the other cache's entries, and skips them all
    (returning False) for a cache of another device unless ignore_mismatch."""

    def __init__(self, device: str, entries: set[str]) -> None:
        self.device, self.entries = device, entries

    def serialize(self) -> bytes:
        return f"{self.device}:{','.join(sorted(self.entries))}".encode()

    def combine(self, other: StandInCache, ignore_mismatch: bool) -> bool:
        if other.device != self.device and not ignore_mismatch:
            return False
        self.entries |= other.entries
        return True


class TimingCacheConfig:
    """Stands in for trt.IBuilderConfig's timing-cache calls (pyCoreDoc.h): create_timing_cache gives None for
    bytes it cannot read; set_timing_cache returns False for another device's cache; get_timing_cache returns
    the cache the build filled (here: with ``tuned``), None when none is set."""

    device = "this-gpu"

    def __init__(self, keep: bool = True, tuned: str = "conv") -> None:
        self.keep, self.tuned = keep, tuned
        self.cache: StandInCache | None = None

    def create_timing_cache(self, data: bytes) -> StandInCache | None:
        device, sep, entries = data.decode().partition(":")
        if data and not sep:
            return None
        return StandInCache(device or self.device, set(filter(None, entries.split(","))))

    def set_timing_cache(self, cache: StandInCache, ignore_mismatch: bool) -> bool:
        if cache.device != self.device and not ignore_mismatch:
            return False
        self.cache = cache
        return True

    def get_timing_cache(self) -> StandInCache | None:
        if not self.keep or self.cache is None:
            return None
        self.cache.entries.add(self.tuned)
        return self.cache


def test_a_timing_cache_from_another_gpu_falls_back_to_an_empty_one(tmp_path, capsys):
    from sdtrt.stages.trt_build_worker import save_timing_cache, use_timing_cache

    path = tmp_path / "cache.bin"
    path.write_bytes(b"other-gpu:gemm")
    config = TimingCacheConfig()
    use_timing_cache(config, path)
    assert config.cache.entries == set() and "was made for another GPU" in capsys.readouterr().err
    save_timing_cache(config, path)
    assert path.read_bytes() == b"this-gpu:conv" and "this build's replaces it" in capsys.readouterr().err
    use_timing_cache(config, tmp_path / "none-yet.bin")
    assert config.cache.entries == set()


def test_builds_sharing_a_timing_cache_keep_each_others_entries(tmp_path, capsys):
    from sdtrt.stages.trt_build_worker import save_timing_cache, use_timing_cache

    path = tmp_path / "cache.bin"
    first, second = TimingCacheConfig(tuned="conv"), TimingCacheConfig(tuned="matmul")
    use_timing_cache(first, path)
    use_timing_cache(second, path)  # both start before either saves
    save_timing_cache(first, path)
    save_timing_cache(second, path)
    assert path.read_bytes() == b"this-gpu:conv,matmul" and capsys.readouterr().err == ""
    path.write_bytes(b"unreadable")
    third = TimingCacheConfig(tuned="pool")
    use_timing_cache(third, path)
    save_timing_cache(third, path)
    assert path.read_bytes() == b"this-gpu:pool"


def test_saving_the_timing_cache_never_fails_the_build(tmp_path, capsys):
    from sdtrt.stages.trt_build_worker import save_timing_cache, use_timing_cache

    save_timing_cache(TimingCacheConfig(keep=False), tmp_path / "cache.bin")
    assert not (tmp_path / "cache.bin").exists() and "kept no timing cache" in capsys.readouterr().err
    blocked = tmp_path / "file"
    blocked.write_text("")
    config = TimingCacheConfig()
    use_timing_cache(config, blocked / "cache.bin")
    save_timing_cache(config, blocked / "cache.bin")  # its folder is a file: cannot be written
    assert "could not write the timing cache" in capsys.readouterr().err
    config.cache.serialize = lambda: None  # no memory for the serialized cache
    save_timing_cache(config, tmp_path / "cache.bin")
    assert not (tmp_path / "cache.bin").exists() and "serialize returned nothing" in capsys.readouterr().err


def test_the_tensorrt_version_comes_from_the_module_not_a_distribution(monkeypatch):
    import sys
    import types
    from importlib import metadata

    from sdtrt.core.gpu import tensorrt_version

    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.8.0.43"))
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version("tensorrt")  # as with only tensorrt-cu12 installed
    assert tensorrt_version() == "10.8.0.43"


def test_container_pins_come_from_installed_versions():
    from sdtrt.core.gpu import pinned_requirements

    pins = pinned_requirements()
    assert f"torch=={torch.__version__}" in pins
    assert all(not p.lower().startswith(("numpy", "diffusers", "onnx")) for p in pins)


def test_an_engine_with_several_profiles_is_not_wrapped(tiny_simplified, tmp_path):
    import json

    from sdtrt.core.artifact import MANIFEST, Artifact
    from sdtrt.core.config import WrapConfig
    from sdtrt.core.store import Store

    folder = tmp_path / "build-trt"
    folder.mkdir()
    profiles = [ShapeProfile().to_json(), ShapeProfile.around(768, 64).to_json()]
    manifest = dict(tiny_simplified.manifest, stage="build-trt", primary="unet.plan", files=[], profiles=profiles)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"2 optimization profiles.*runs profile 0 only"):
        wrap.run(WrapConfig(), Artifact.open(folder), Store(tmp_path))  # refused before torch-tensorrt is needed


# ---- issue 24: runtime, build, wrap and debug defects ------------------------------------------------------------


def test_a_refused_capture_leaves_no_graph_for_the_old_shape():
    """Item 2: a request that fails to bind (out of profile) must not leave the old shape marked as captured."""
    from sdtrt.core.errors import EngineInputError
    from sdtrt.runtime.tensorrt import CapturedGraph

    captures = []

    def capture(fails: bool = False):
        captures.append(fails)
        if fails:  # _bind raises before capture: the context is already re-bound for the new shape
            raise EngineInputError("input 'sample' has shape (2, 4, 64, 64), outside every optimization profile")
        return f"graph {len(captures)}", {"out_sample": torch.zeros(1)}

    graph, small, large = CapturedGraph(), ((2, 4, 32, 32),), ((2, 4, 64, 64),)
    graph.capture(small, capture)
    graph.capture(small, capture)  # replayed, not re-captured
    assert captures == [False] and graph.graph == "graph 1"
    with pytest.raises(EngineInputError):
        graph.capture(large, lambda: capture(fails=True))
    assert graph.graph is None and not graph.replayable(small)
    graph.capture(small, capture)  # captured again for the context's new binding
    assert captures == [False, True, False] and graph.graph == "graph 3" and graph.replayable(small)


def test_fp32_means_fp32_and_only_tf32_off_enters_the_key(tiny_simplified, tmp_path):
    """Item 3: TF32 is off for fp32 graphs unless asked; engines keyed as before keep their keys."""
    from sdtrt.core.config import cache_key

    assert TrtBuildConfig().tf32_for("fp32") is False and TrtBuildConfig().tf32_for("fp16") is True
    assert TrtBuildConfig(tf32=True).tf32_for("fp32") is True and TrtBuildConfig(tf32=False).tf32_for("fp16") is False
    # The build stage keys the resolved value. TF32 on is what every earlier build did: those keys stay.
    off = cache_key(TrtBuildConfig(tf32=False))
    assert off.pop("tf32") is False and cache_key(TrtBuildConfig(tf32=True)) == off
    assert build_trt.worker_request(TrtBuildConfig(), tiny_simplified, tmp_path)["tf32"] is True  # an fp16 graph
    request = build_trt.worker_request(TrtBuildConfig(tf32=False), tiny_simplified, tmp_path, device=1)
    assert request["tf32"] is False and request["device"] == 1  # item 6: the child builds on the recorded GPU


def test_debug_rebuilds_with_the_engines_own_tf32():
    """Item 3: `sdtrt debug` checks the arithmetic the engine ships with; engines older than the setting had TF32."""
    from sdtrt.stages.build_trt import built_with_tf32

    assert built_with_tf32({"config": {"optimization_level": 3}}) is True
    assert built_with_tf32({"config": {"tf32": False}}) is False and built_with_tf32({"config": {"tf32": True}})


def test_the_rebuild_advice_repeats_every_setting():
    """Item 6: rebuilding must keep --refittable, the optimization level, the profile and TF32."""
    from sdtrt.core.gpu import rebuild_command

    config = TrtBuildConfig(
        profiles=(ShapeProfile(Range(1, 1, 2), Range(256, 512, 768), Range(256, 512, 768)),),
        optimization_level=5,
        refittable=True,
        tf32=False,
        workspace_gb=8.0,
    )
    command = build_trt.reproduce_command(config, Path("engines/simplify/abc"))
    assert command == (
        "sdtrt build engines/simplify/abc --target tensorrt --batch 1:1:2 --height 256:512:768 --width 256:512:768 "
        "--optimization-level 5 --workspace-gb 8.0 --refittable --no-tf32"
    )
    assert rebuild_command({"reproduce": command, "inputs": [{"path": "x"}]}) == command
    assert rebuild_command({"inputs": [{"path": "engines/simplify/abc"}]}).startswith(
        "sdtrt build engines/simplify/abc"
    )


def test_the_out_of_profile_error_names_the_input_out_of_range():
    """Item 6: a ControlNet's control image may be the one out of range, not the first input."""
    from sdtrt.runtime.trt_engine_io import out_of_profile

    profile = {
        "sample": ((2, 4, 32, 32), (2, 4, 64, 64), (2, 4, 96, 96)),
        "controlnet_cond": ((2, 3, 256, 256), (2, 3, 512, 512), (2, 3, 768, 768)),
    }
    message = out_of_profile([profile], {"sample": (2, 4, 64, 64), "controlnet_cond": (2, 3, 1024, 512)})
    assert message.startswith("input 'controlnet_cond' has shape (2, 3, 1024, 512)")
    assert "profile 0: (2, 3, 256, 256) .. (2, 3, 768, 768)" in message
    small = {name: (lo, lo, lo) for name, (lo, _, _) in profile.items()}
    large = {name: (hi, hi, hi) for name, (_, _, hi) in profile.items()}
    both = {"sample": (2, 4, 32, 32), "controlnet_cond": (2, 3, 768, 768)}  # each fits one profile, none fits both
    assert select_profile([small, large], both) is None
    assert "fit no single optimization profile" in out_of_profile([small, large], both)


def test_refit_base_weights_are_read_by_name_and_once(tiny_simplified, tmp_path):
    """Item 4: the weights a refit must supply come from the graph's named tensors only, each read once."""
    import shutil

    import onnx
    from onnx import numpy_helper

    from sdtrt.core.errors import LoraError
    from sdtrt.runtime.trt_refit import BaseWeights

    folder = tmp_path / "graph"
    shutil.copytree(tiny_simplified.path, folder)
    graph = folder / tiny_simplified.primary.name
    everything = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(graph)).graph.initializer}
    names = {name for name, value in everything.items() if value.ndim == 1}  # biases: what a fused layer misses
    names = set(sorted(names)[:3])
    base = BaseWeights(graph)
    got = base(names)
    assert set(got) == names and all(np.array_equal(got[n], everything[n]) for n in names)
    for data in folder.glob("*.data"):
        data.unlink()  # a second refit reads nothing: the graph's weights are not needed again
    assert all(np.array_equal(base(names)[n], everything[n]) for n in names)
    # Review 4, M5: the parser also names weights after constants it makes, so a missing name proves no wrong graph
    with pytest.raises(
        LoraError, match=r"not an initializer of .*a constant the parser made.* without `--engine`"
    ) as e:
        base(names | {"onnx::Conv_fused_bias"})
    assert "weight map" not in str(e.value) and "not built from this graph" not in str(e.value)


def test_a_refit_supplies_base_weights_from_the_graph_the_plan_was_parsed_from(tiny_simplified, tmp_path):
    """A quantized plan is parsed from the quantize stage's TensorRT graph (16-bit outside its Q/DQ pairs), never from
    the primary graph of the artifact it was built from (ONNX Runtime's fp32 one, simplified on compile's way), so the
    weights a refit must supply come from the graph the build parsed, found in a moved store too."""
    import shutil

    from sdtrt.core.artifact import MANIFEST, Artifact
    from sdtrt.runtime.trt_refit import parsed_graph
    from sdtrt.stages.quantize import tensorrt_graph

    store = tmp_path / "engines"
    quantized, simplified, plan = store / "quantize" / "q", store / "simplify" / "s", store / "build-trt" / "b" / "x"
    graphs = {"tensorrt": "unet.trt.onnx", "onnxruntime": "unet.onnx"}
    made_from = [{"kind": "artifact", "path": str(quantized)}]
    manifests = {
        quantized: {"stage": "quantize", "primary": "unet.onnx", "graphs": graphs, "inputs": [{"kind": "model"}]},
        simplified: {"stage": "simplify", "primary": "unet.sim.onnx", "inputs": made_from},
    }
    for folder, manifest in manifests.items():
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text(json.dumps(manifest))
    request = {"onnx": str(tensorrt_graph(Artifact.open(simplified)))}  # what build_trt.worker_request names
    built = {"details": {"worker_request": request}}
    assert parsed_graph(built, plan) == quantized / "unet.trt.onnx"
    shutil.move(store, tmp_path / "moved")
    assert (
        parsed_graph(built, tmp_path / "moved" / "build-trt" / "b" / "x") == tmp_path / "moved/quantize/q/unet.trt.onnx"
    )

    request = build_trt.worker_request(TrtBuildConfig(), tiny_simplified, tmp_path)
    assert parsed_graph({"details": {"worker_request": request}}, plan) == tiny_simplified.primary


def test_compile_knows_before_building_whether_it_can_wrap():
    """Item 6: a missing torch-tensorrt is found before any plan is built, and the plans are kept unwrapped."""
    from sdtrt.tools.compile import wrap_problem

    assert wrap_problem(TrtBuildConfig(), None) is None
    assert "torch-tensorrt is not installed, so the engines are not wrapped" in wrap_problem(
        TrtBuildConfig(), "torch-tensorrt is not installed"
    )
    two = TrtBuildConfig(profiles=(ShapeProfile(), ShapeProfile.around(768, 64)))
    assert "2 optimization profiles" in wrap_problem(two, None)
    # Review 4, M6: Torch-TensorRT would set TensorRT's automatic budget itself; sdtrt has no way to pass its own.
    streamed = wrap_problem(TrtBuildConfig(weight_streaming=True), None)
    assert "not offered yet" in streamed and "automatic budget and sdtrt has no way to pass one" in streamed


def test_a_weight_budget_for_engines_that_do_not_stream_is_refused_before_loading(tiny, tiny_engine):
    """The budget is an argument (load_pipeline, ValidationConfig), not a process-wide variable; engines without
    weight streaming (here ONNX Runtime's) cannot take one, and saying so beats ignoring it."""
    from sdtrt.core.config import ValidationConfig, WeightBudget
    from sdtrt.core.errors import RequestError
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.tools.validate import validate

    from .helpers import last_line, run_cli

    with pytest.raises(RequestError, match="built with --weight-streaming, and none of these was"):
        load_pipeline(tiny, tiny_engine, weight_budget="50%")
    with pytest.raises(RequestError, match="none of these was"):
        validate(tiny, tiny_engine, ValidationConfig(weight_budget=WeightBudget.parse("8GiB")))
    result = run_cli("generate", "--model", "tiny", "--engine", str(tiny_engine.path), "--weight-streaming-budget", "1")
    assert result.returncode == 2 and "none of these was" in last_line(result.stderr)


def test_base_weights_read_with_the_onnx_of_the_container(tiny_simplified, tmp_path, monkeypatch):
    """Review of issue 24: older onnx (1.17 included; pyproject allows >=1.16) loads a tensor's external data
    without marking it loaded, and its to_array then reads the data again relative to the working directory."""
    import onnx
    from onnx import external_data_helper, numpy_helper

    from sdtrt.graph.graph_weights import read_initializers

    def load_as_onnx_117(tensor: onnx.TensorProto, base_dir: str) -> None:  # onnx 1.17 external_data_helper.py
        with open(Path(base_dir) / external_data_helper.ExternalDataInfo(tensor).location, "rb") as data_file:
            info = external_data_helper.ExternalDataInfo(tensor)
            data_file.seek(info.offset or 0)
            tensor.raw_data = data_file.read(info.length) if info.length else data_file.read()

    graph = tmp_path / "graph" / "unet.onnx"  # as a real UNet's: its weights in external data
    graph.parent.mkdir()
    full = onnx.load(str(tiny_simplified.primary))
    expected = {i.name: numpy_helper.to_array(i) for i in full.graph.initializer}
    onnx.save_model(full, str(graph), save_as_external_data=True, location="unet.onnx.data", size_threshold=0)
    model = onnx.load(str(graph), load_external_data=False)
    external = [i.name for i in model.graph.initializer if external_data_helper.uses_external_data(i)]
    monkeypatch.chdir(tmp_path)  # not the graph's folder: a path relative to it must not resolve here
    monkeypatch.setattr(external_data_helper, "load_external_data_for_tensor", load_as_onnx_117)
    got = read_initializers(graph, set(external[:3]))
    assert all(np.array_equal(got[name], expected[name]) for name in external[:3])


def test_the_reproduce_command_parses_with_the_cli(tmp_path):
    """Review of issue 24: the manifest's `reproduce` is advice users paste: it must parse, path spaces and all."""
    import shlex

    from typer.main import get_command

    from sdtrt.cli import app

    source = tmp_path / "my engines" / "simplify" / "abc"
    profile = ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384))
    config = TrtBuildConfig(
        profiles=(profile,), static_shapes=True, workspace_gb=2.5, refittable=True, tf32=False, optimization_level=5
    )
    words = shlex.split(build_trt.reproduce_command(config, source))
    assert words[:3] == ["sdtrt", "build", str(source)]
    group = get_command(app)
    build = group.get_command(group.make_context("sdtrt", ["build", "x"]), "build")
    params = build.make_context("build", words[2:]).params
    assert params["source"] == str(source) and (params["batch"], params["height"]) == ("1:1:2", "128:256:384")
    assert params["static"] and params["refittable"] and params["tf32"] is False
    assert (params["workspace_gb"], params["optimization_level"], params["target"]) == (2.5, 5, "tensorrt")


def test_validation_holds_a_tf32_engine_to_the_tolerances_of_its_arithmetic(tmp_path):
    """Item 3: an fp32 engine that computes in TF32 (asked with --tf32, or built before the setting) is held to
    fp16's tolerances, through its wrap too; an fp32 engine built without TF32 keeps fp32's."""
    from sdtrt.core.artifact import MANIFEST, Artifact
    from sdtrt.tools.validate import tolerance_precision

    def artifact(name: str, stage: str, config: dict, source: Path | None = None) -> Artifact:
        folder = tmp_path / name
        folder.mkdir()
        inputs = [{"kind": "artifact", "stage": "build-trt", "path": str(source)}] if source else []
        manifest = {"stage": stage, "key": name, "config": config, "inputs": inputs}
        (folder / MANIFEST).write_text(json.dumps(manifest))
        return Artifact.open(folder)

    tf32 = artifact("tf32", "build-trt", {"tf32": True})
    strict = artifact("strict", "build-trt", {"tf32": False})
    older = artifact("older", "build-trt", {"optimization_level": 3})
    assert tolerance_precision(tf32, "fp32") == "fp16" and tolerance_precision(older, "fp32") == "fp16"
    assert tolerance_precision(strict, "fp32") == "fp32"
    assert tolerance_precision(artifact("wrap", "wrap", {}, tf32.path), "fp32") == "fp16"
    assert tolerance_precision(artifact("wrap2", "wrap", {}, strict.path), "fp32") == "fp32"
    assert tolerance_precision(tf32, "fp16") == "fp16"


# ---- issue 20: bf16, the optimization level rule, weight streaming ----------------------------------------------


def test_weight_streaming_is_a_build_flag_keyed_only_when_on(tiny_simplified, tmp_path):
    def key(**config) -> str:
        return StageRequest("build-trt", 2, TrtBuildConfig(**config), [{"digest": "x"}], {}).key

    assert key() == key(weight_streaming=False)  # earlier engines keep their keys
    assert key() != key(weight_streaming=True)
    request = build_trt.worker_request(TrtBuildConfig(weight_streaming=True), tiny_simplified, tmp_path)
    assert request["weight_streaming"] is True
    assert "--weight-streaming" in build_trt.reproduce_command(TrtBuildConfig(weight_streaming=True), tmp_path)


def test_the_optimization_level_follows_the_parameter_count(tiny_simplified, tmp_path):
    from sdtrt.core.config import default_optimization_level

    assert default_optimization_level(2_500_000_000) == (3, "2.5 B parameters: TensorRT's default level 3")
    assert "TensorRT's default" in default_optimization_level(1_000_000)[1]
    parameters = build_trt.parameter_count(tiny_simplified.primary)
    assert 0 < parameters < 10_000_000
    config, why = build_trt.resolved(TrtBuildConfig(), tiny_simplified)
    assert config.optimization_level == 3 and f"{parameters / 1e6:.0f} M parameters" in why
    # Resolved before keying: the default keys as the explicit 3 that every earlier build had.
    assert (
        StageRequest("b", 2, config, [], {}).key
        == StageRequest("b", 2, TrtBuildConfig(optimization_level=3, tf32=True), [], {}).key
    )
    assert build_trt.resolved(TrtBuildConfig(optimization_level=5), tiny_simplified)[0].optimization_level == 5
    assert build_trt.worker_request(TrtBuildConfig(), tiny_simplified, tmp_path)["optimization_level"] == 3


def test_bf16_graphs_build_like_fp16_ones():
    """Strongly typed bf16 is not "fp32": its few fp32 layers keep TensorRT's TF32 default, as fp16's do."""
    assert TrtBuildConfig().tf32_for("bf16") is True and TrtBuildConfig().tf32_for("fp32") is False


@pytest.mark.parametrize(
    ("text", "streamable", "expected"),
    [("50%", 1000, 500), ("0%", 1000, 0), ("1GiB", 10, 1 << 30), ("512MB", 10, 512_000_000), ("0", 10, 0)],
)
def test_weight_budgets_in_bytes(text, streamable, expected):
    from sdtrt.core.config import WeightBudget
    from sdtrt.runtime.trt_weight_streaming import weight_budget_bytes

    assert weight_budget_bytes(WeightBudget.parse(text), streamable, lambda: 1 / 0, lambda: 1 / 0) == expected


def truncated_to_int32(budget: int):
    """What TensorRT's Python binding hands back: the int64 budget through an int32_t (pyCore.cpp)."""
    return lambda: ctypes.c_int32(budget).value


def test_a_truncated_automatic_budget_is_recovered_or_refused():
    """pyCore.cpp binds get_weight_streaming_automatic_budget through an int32_t, so only the budget's low 32 bits
    come back: negative, or positive and wrong. The budget is at most the streamable size and close under the free
    memory (NvInferRuntime.h), so it is recovered where one value fits, or one fits under the free memory (review 4,
    M2: a Flux transformer streams ~24 GB, where `auto` was always refused); refused otherwise, never guessed."""
    from sdtrt.core.config import WeightBudget
    from sdtrt.runtime.trt_weight_streaming import weight_budget_bytes

    auto = WeightBudget.parse("auto")
    no_free = lambda: 0  # noqa: E731 -- one fitting value needs no free memory to tell it
    assert weight_budget_bytes(auto, 10, truncated_to_int32(7), no_free) == 7
    assert weight_budget_bytes(auto, 3 << 30, truncated_to_int32(5 << 29), no_free) == 5 << 29  # 2.5 GiB: negative
    budget = (5 << 30) + (1 << 20)  # reads as 1 GiB + 1 MiB: 1, 5 or 9 GiB (+ 1 MiB) of 10 GiB streamable
    assert weight_budget_bytes(auto, 10 << 30, truncated_to_int32(budget), lambda: (5 << 30) + (600 << 20)) == budget
    flux = 24 << 30  # streamable; TensorRT caps its budget there when the GPU has more free
    assert weight_budget_bytes(auto, flux, truncated_to_int32(flux), lambda: 70 << 30) == flux
    with pytest.raises(ConfigError, match=r"none of them within the GPU's .* percentage or a size"):
        weight_budget_bytes(auto, 10 << 30, truncated_to_int32(budget), lambda: 1 << 29)


@pytest.mark.parametrize("text", ["-1", "150%", "lots", "inf", "8XB"])
def test_malformed_weight_budgets_are_refused(text):
    from sdtrt.core.config import WeightBudget

    with pytest.raises(ConfigError, match="weight streaming budget"):
        WeightBudget.parse(text)


@pytest.mark.parametrize(
    ("precision", "capability", "refused"),
    [("bf16", "7.5", True), ("bf16", "8.0", False), ("bf16", "12.0", False), ("fp16", "7.5", False)],
)
def test_a_bf16_graph_needs_ampere_whatever_its_quantization(precision, capability, refused):
    """A quantized Flux's TensorRT graph is bf16 outside its Q/DQ pairs: an INT8 Flux engine, whose format Turing runs,
    still needs Ampere for its bf16 layers (NvInfer.h kBF16), said before the build, not by TensorRT minutes in."""
    from sdtrt.core.gpu import quantization_problem

    problem = build_trt.graph_precision_problem(precision, capability, "NVIDIA T4")
    assert (problem is not None) == refused
    if refused:
        assert quantization_problem("int8", capability) is None  # the format alone would pass
        assert "\n" not in problem and "compute capability 8.0 or newer" in problem and "NVIDIA T4 has 7.5" in problem


@pytest.mark.parametrize(("preset", "precision"), [("tiny", "bf16"), ("tiny-flux", "int8")])
def test_compile_refuses_a_bf16_graph_before_exporting_or_calibrating(preset, precision, store, monkeypatch):
    """On a Turing GPU (a T4's 7.5, given here in place of the GPU), a bf16 compile and a quantized Flux (bf16 outside
    its Q/DQ pairs; INT8 itself runs on 7.5) are refused before any export or calibration: they were refused only by
    the build, after them."""
    from sdtrt.core import gpu
    from sdtrt.core.config import ExportConfig, QuantizeConfig
    from sdtrt.sources.models import resolve_model
    from sdtrt.stages import export, quantize
    from sdtrt.tools import compile as compile_module

    t4 = {"gpu": "NVIDIA T4", "compute_capability": "7.5"}
    for module in (gpu, build_trt):
        monkeypatch.setattr(module, "gpu_environment", lambda: t4)
    monkeypatch.setattr(compile_module, "require_tensorrt", lambda: None)

    def work(*args, **kwargs):
        raise AssertionError("exported or calibrated before the GPU was checked")

    monkeypatch.setattr(export, "run", work)
    monkeypatch.setattr(quantize, "run", work)
    quantized = QuantizeConfig(precision=precision) if precision == "int8" else None
    export_config = ExportConfig(precision="fp16" if quantized else precision)
    with pytest.raises(MissingDependencyError, match=r"bf16 graphs need a GPU of compute capability 8\.0 or newer"):
        compile_module.compile_model(resolve_model(preset), store, "tensorrt", export_config, quantize_config=quantized)


def test_bf16_is_refused_for_onnxruntime_before_any_work(tmp_path):
    from sdtrt.core.config import BenchConfig

    from .helpers import last_line, run_cli

    result = run_cli("compile", "--target", "onnxruntime", "--precision", "bf16", "--engines", str(tmp_path / "e"))
    assert result.returncode == 2
    assert "ONNX Runtime on a CPU cannot run bf16 graphs" in last_line(result.stderr)
    assert not (tmp_path / "e").exists()  # nothing exported, no store made
    with pytest.raises(ConfigError, match="cannot run bf16"):
        BenchConfig(backends=("onnxruntime:bf16",))
    with pytest.raises(ConfigError, match="cannot run bf16"):
        BenchConfig(backends=("torch", "onnxruntime"), precision="bf16")
    assert BenchConfig(backends=("tensorrt:bf16",)).backends == ("tensorrt:bf16",)


def test_the_weight_streaming_options_are_checked_at_the_cli():
    from .helpers import last_line, run_cli

    result = run_cli("validate", "--engine", "nowhere", "--weight-streaming-budget", "lots")
    assert result.returncode == 2 and "weight streaming budget 'lots'" in last_line(result.stderr)
    assert "--weight-streaming" in run_cli("compile", "--help").stdout
    assert "--weight-streaming" in run_cli("build", "--help").stdout
    assert "bf16" in run_cli("compile", "--help").stdout


def test_bf16_engines_are_held_to_looser_tolerances():
    from sdtrt.tools.validate import Tolerances, least_precise

    bf16, fp16 = Tolerances.for_precision("bf16"), Tolerances.for_precision("fp16")
    assert bf16.min_cosine < fp16.min_cosine and bf16.max_abs > fp16.max_abs and bf16.min_psnr_db < fp16.min_psnr_db
    assert least_precise(["fp32", "bf16", "fp16"]) == "bf16" and least_precise(["fp32", "fp16"]) == "fp16"


# ---- issue 21: weight-stripped plans ------------------------------------------------------------------------------


def test_strip_weights_is_a_build_flag_keyed_only_when_on(tiny_simplified, tmp_path):
    def key(**config) -> str:
        return build_trt.stage_request(TrtBuildConfig(**config), tiny_simplified, {}).key

    assert key() == key(strip_weights=False)  # earlier engines keep their keys
    assert key() != key(strip_weights=True)
    request = build_trt.worker_request(TrtBuildConfig(strip_weights=True), tiny_simplified, tmp_path)
    assert request["strip_weights"] is True and request["onnx"] == str(tiny_simplified.primary)
    assert build_trt.worker_request(TrtBuildConfig(), tiny_simplified, tmp_path)["strip_weights"] is False


def test_a_stripped_plan_is_keyed_by_its_graphs_content(tiny_simplified, tmp_path):
    """The same simplify key with other bytes (a non-deterministic export made again) must not hit the old plan."""
    import copy

    from sdtrt.core.artifact import Artifact

    again = copy.deepcopy(tiny_simplified.manifest)
    again["files"][0]["sha256"] = "0" * 64
    remade = Artifact(tiny_simplified.path, again)
    assert remade.key == tiny_simplified.key

    def key(source: Artifact, strip: bool) -> str:
        return build_trt.stage_request(TrtBuildConfig(strip_weights=strip), source, {}).key

    assert key(remade, True) != key(tiny_simplified, True)
    assert key(remade, False) == key(tiny_simplified, False)  # a plan with its weights does not care


def test_a_stripped_plan_records_the_graph_that_refills_it(tiny_simplified, tmp_path):
    from sdtrt.core.artifact import Artifact

    assert refill_graph({"config": {}}, tmp_path / "unet.plan") is None  # a plan with its weights
    manifest = {"weights": build_trt.refill_record(tiny_simplified)}
    assert manifest["weights"]["in_plan"] is False
    recorded = manifest["weights"]["refill_from"]
    assert recorded["artifact"] == str(tiny_simplified.path.resolve())
    assert recorded["graph"] == tiny_simplified.primary.name
    assert tiny_simplified.primary.name in recorded["files"]
    assert recorded["digest"] == graph_digest(Artifact.open(tiny_simplified.path))
    assert refill_graph(json.loads(json.dumps(manifest)), tmp_path / "unet.plan") == tiny_simplified.primary


def test_a_stripped_plan_whose_graph_is_gone_or_changed_is_refused(tiny_simplified, tmp_path):
    """The load checks the graph against the digest the build recorded, before TensorRT reads anything."""
    import shutil

    from sdtrt.core.artifact import Artifact

    folder = tmp_path / "simplify" / "graph"
    shutil.copytree(tiny_simplified.path, folder)
    graph = Artifact.open(folder)
    manifest = {"weights": build_trt.refill_record(graph)}
    plan = tmp_path / "unet.plan"
    assert refill_graph(manifest, plan) == graph.primary

    data = graph.primary  # the tiny graph keeps its weights inline; a big one's .data file is checked alike
    original = data.read_bytes()
    data.write_bytes(original[:-4] + bytes(4 * [original[-1] ^ 1]))  # same size, other bytes
    with pytest.raises(ArtifactError, match=r"holds no weights \(built with --strip-weights\).*differs from the"):
        refill_graph(manifest, plan)
    data.write_bytes(original)

    assert refill_graph(manifest, plan) == graph.primary  # intact again
    built_from_other = {"weights": build_trt.refill_record(graph)}
    built_from_other["weights"]["refill_from"]["digest"] = "0" * 64  # the graph was made again since, intact
    with pytest.raises(ArtifactError, match="it was made again since, with other content"):
        refill_graph(built_from_other, plan)

    shutil.rmtree(folder)
    with pytest.raises(ArtifactError, match="it is gone; make the graph and the engine again") as gone:
        refill_graph(manifest, plan)
    assert str(graph.primary) in str(gone.value) and "without --strip-weights" in str(gone.value)


def test_only_store_graphs_are_stripped(tiny_simplified, store, tmp_path):
    """An .onnx outside the store could change under the plan unchecked: refused before any TensorRT work."""
    import shutil

    from sdtrt.core.artifact import Artifact

    folder = tmp_path / "mine"
    shutil.copytree(tiny_simplified.path, folder)
    (folder / "manifest.json").unlink()
    external = Artifact.open(folder / tiny_simplified.primary.name)
    assert external.stage == "external"
    with pytest.raises(ConfigError, match="outside the store; put it through `sdtrt simplify"):
        build_trt.run(TrtBuildConfig(strip_weights=True), external, store)


def test_stripped_plans_are_never_wrapped(store, tmp_path):
    """Torch-TensorRT deserializes a wrapped plan itself: nothing would refill its weights."""
    from sdtrt.core.artifact import Artifact
    from sdtrt.tools.compile import wrap_problem

    assert "hold no weights (--strip-weights), so they are not wrapped" in wrap_problem(
        TrtBuildConfig(strip_weights=True), None
    )
    stripped = Artifact(tmp_path, {"stage": "build-trt", "profiles": [{}], "weights": {"in_plan": False}})
    with pytest.raises(ArtifactError, match=r"holds no weights \(built with --strip-weights\)"):
        wrap.run(wrap.WrapConfig(), stripped, store)


def test_the_strip_weights_option_reaches_the_build(tmp_path):
    import shlex

    from typer.main import get_command

    from sdtrt.cli import app

    from .helpers import run_cli

    assert "--strip-weights" in run_cli("compile", "--help").stdout
    assert "--strip-weights" in run_cli("build", "--help").stdout
    config = TrtBuildConfig(refittable=True, strip_weights=True)
    words = shlex.split(build_trt.reproduce_command(config, tmp_path))
    group = get_command(app)
    build = group.get_command(group.make_context("sdtrt", ["build", "x"]), "build")
    params = build.make_context("build", words[2:]).params
    assert params["strip_weights"] and params["refittable"]


def test_a_stripped_plan_finds_its_graph_from_any_working_directory(tiny_simplified, tmp_path, monkeypatch):
    """The default store is ./engines, a relative path: the plan must not record the graph relative to where it was
    built, or a load from another directory would call the graph gone."""
    import shutil

    from sdtrt.core.artifact import Artifact

    shutil.copytree(tiny_simplified.path, tmp_path / "engines" / "simplify" / "graph")
    monkeypatch.chdir(tmp_path)
    graph = Artifact.open(Path("engines/simplify/graph"))
    manifest = {"weights": build_trt.refill_record(graph)}
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    found = refill_graph(manifest, tmp_path / "unet.plan")
    assert found is not None and found.resolve() == (tmp_path / "engines/simplify/graph" / graph.primary.name)


def test_a_stripped_plan_takes_its_graph_along_to_a_moved_store_and_a_triton_repository(tiny_simplified, tmp_path):
    """The recorded path is where the graph was built; a store moved elsewhere, or the repository `sdtrt deploy`
    writes (a store of its own), holds the graph beside the plan, under the same stage and key."""
    import shutil

    from sdtrt.core.artifact import Artifact
    from sdtrt.serving.deploy import refill_graphs

    built = tmp_path / "engines"
    shutil.copytree(tiny_simplified.path, built / "simplify" / "graph")
    (built / "build-trt" / "plan").mkdir(parents=True)
    record = build_trt.refill_record(Artifact.open(built / "simplify" / "graph"))
    graph_input = Artifact.open(built / "simplify" / "graph").as_input()
    (built / "build-trt" / "plan" / "manifest.json").write_text(
        json.dumps({"stage": "build-trt", "primary": "unet.plan", "weights": record, "inputs": [graph_input]})
    )
    plan = Artifact.open(built / "build-trt" / "plan")
    assert [a.path for a in refill_graphs([plan, Artifact.open(built / "simplify" / "graph")])] == [
        built / "simplify" / "graph"  # the graph a deployment links beside the plan; a plan with weights needs none
    ]

    moved = Path(shutil.move(built, tmp_path / "elsewhere"))
    found = refill_graph({"weights": record}, moved / "build-trt" / "plan" / "unet.plan")
    assert found == moved / "simplify" / "graph" / tiny_simplified.primary.name
    # The weight map and LoRA base weights follow the plan's lineage, found there too (a graph_input's path is gone).
    assert Artifact.open(moved / "build-trt" / "plan").lineage()[1].path == moved / "simplify" / "graph"


def test_the_graph_of_a_stripped_plan_stays_in_use_for_gc(tiny_simplified, tmp_path):
    """`cache gc --older-than` removes artifacts by last use: the graph a stripped plan refills from is used at every
    load and at the build (`sdtrt build <simplify dir>` opens it by path, no cache hit marks it), so it must never
    look older than the plan it keeps alive."""
    import os
    import shutil
    import time

    from sdtrt.core.artifact import MANIFEST, Artifact
    from sdtrt.core.store import Store

    root = tmp_path / "engines"
    folder = root / "simplify" / "graph"
    shutil.copytree(tiny_simplified.path, folder)
    graph = Artifact.open(folder)
    ten_days_ago = time.time() - 10 * 86400

    def is_kept_by_gc() -> bool:
        return folder not in Store(root).gc(older_than_days=5, dry_run=True).removed

    os.utime(folder / MANIFEST, (ten_days_ago, ten_days_ago))
    assert not is_kept_by_gc()
    with pytest.raises(MissingDependencyError):  # no TensorRT here: the graph is marked before any TensorRT work
        build_trt.run(TrtBuildConfig(strip_weights=True), graph, Store(root))
    assert is_kept_by_gc()

    os.utime(folder / MANIFEST, (ten_days_ago, ten_days_ago))
    assert refill_graph({"weights": build_trt.refill_record(graph)}, tmp_path / "unet.plan") == graph.primary
    assert is_kept_by_gc()


def test_a_quantized_graph_is_not_stripped(store, tmp_path):
    """A quantized plan is built from the quantize stage's TensorRT graph, not the primary graph a stripped plan
    would be refilled from: refused before any TensorRT work."""
    from sdtrt.core.artifact import Artifact

    quantized = Artifact(tmp_path, {"stage": "quantize", "config": {"precision": "int8"}, "inputs": [{}]})
    with pytest.raises(ConfigError, match="--strip-weights is not offered for int8 engines yet"):
        build_trt.run(TrtBuildConfig(strip_weights=True), quantized, store)
