"""Real TensorRT-RTX plans, built here on the CPU (no GPU needed) by the build worker the datacenter TensorRT uses.

Each build runs NVIDIA's real tensorrt_rtx library in the worker process and is checked for what was built: the plan's
magic bytes and size, the manifest, the parsed network's layer types. Seconds per tiny component.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import DEFAULT_PROMPT, ExportConfig, QuantizeConfig, SimplifyConfig, TrtBuildConfig
from sdtrt.core.errors import MissingDependencyError
from sdtrt.core.trt_products import (
    COMPUTE_CAPABILITIES,
    DEFAULT_COMPUTE_CAPABILITIES,
    TENSORRT_RTX,
    rtx_runtime_missing,
)
from sdtrt.graph.onnx_graph import artifact_spec
from sdtrt.sources.models import resolve_model
from sdtrt.stages import build_trt, export, quantize, simplify
from sdtrt.tools.compile import build

from .helpers import REPO, last_line, run_cli
from .trt_api import check_source, load_module_api

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_rtx") is None,
    reason="TensorRT-RTX is not installed: pip install 'sdtrt[rtx]' (the dev extra has it)",
)

# Measured with tensorrt_rtx 1.7.1.116 (sdtrt/core/trt_products.py, Product.refit_needs_gpu).
GPU_ONLY = "TensorRT-RTX builds refittable and weight-stripped plans only where a CUDA GPU is visible"
# What each graph precision's layers compute in, as the manifest spells layer types.
LAYER_TYPE = {"fp16": "HALF", "bf16": "BF16", "fp32": "FLOAT"}


def rtx_version() -> str:
    import tensorrt_rtx

    return str(tensorrt_rtx.__version__)


@pytest.fixture(scope="module")
def graph(store):
    """(preset, component, precision) → its simplified graph, as compile makes it."""

    def get(preset: str, component: str, precision: str = "fp16"):
        exported = export.run(ExportConfig(precision=precision, component=component), resolve_model(preset), store)
        return simplify.run(SimplifyConfig(), exported, store)

    return get


def rtx_build(source, store, **settings):
    profile = artifact_spec(source).default_profile()
    return build(
        source,
        store,
        "tensorrt-rtx",
        trt_config=TrtBuildConfig(profiles=(profile,), product="tensorrt-rtx", **settings),
    )[0]


def check_plan(plan, precision: str, min_bytes: int) -> dict:
    """The plan is TensorRT-RTX's, of a plausible size, and its manifest says what was built; returns its details."""
    head = plan.primary.read_bytes()[:4]
    size = plan.primary.stat().st_size
    details = plan.manifest["details"]
    print(f"\n{plan.primary.name} ({precision}): {size / 1e6:.1f} MB in {plan.manifest['timings']['build_s']:.1f} s; "
          f"{details['layers']}")  # fmt: skip
    assert head == TENSORRT_RTX.plan_magic == b"vtrt"
    assert size >= min_bytes and size == details["plan_bytes"]
    assert plan.manifest["target"] == "tensorrt-rtx" and plan.manifest["config"]["product"] == "tensorrt-rtx"
    assert plan.manifest["environment"]["tensorrt-rtx"] == details["tensorrt-rtx"] == rtx_version()
    assert "tensorrt" not in plan.manifest["environment"] and "gpu" not in plan.manifest["environment"]
    layer_types = details["layer_types"]
    assert layer_types[LAYER_TYPE[precision]] > 0, layer_types
    assert sum(layer_types.values()) <= details["network_layers"]  # layers without outputs are not counted
    assert (
        details["layers"].startswith(f"{sum(layer_types.values())} layers: ") and f" {precision}" in details["layers"]
    )
    assert details["optimization_level"]["level"] is None  # TensorRT-RTX does no autotuning: nothing is set
    assert plan.manifest["reproduce"].split()[3:5] == ["--target", "tensorrt-rtx"]
    return details


@pytest.mark.parametrize(
    ("preset", "component", "precision", "min_bytes"),
    [
        ("tiny", "unet", "fp16", 5_000_000),
        ("tiny", "text_encoder", "fp16", 1_000_000),
        ("tiny", "vae_decoder", "fp32", 2_000_000),  # tiny's VAE asks to be upcast: fp32, as compile exports it
        ("tiny-flux", "transformer", "bf16", 1_000_000),
        ("tiny-sd3", "transformer", "fp16", 2_000_000),
    ],
)
def test_a_real_plan_is_built_from_each_kind_of_graph(graph, store, preset, component, precision, min_bytes):
    details = check_plan(rtx_build(graph(preset, component, precision), store), precision, min_bytes)
    assert details["compute_capabilities"] == DEFAULT_COMPUTE_CAPABILITIES


def test_a_weight_streaming_plan_builds_and_says_so(graph, store):
    source = graph("tiny", "unet")
    streaming = rtx_build(source, store, weight_streaming=True)
    assert streaming.key != rtx_build(source, store).key
    check_plan(streaming, "fp16", 5_000_000)
    assert streaming.manifest["details"]["worker_request"]["weight_streaming"] is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs a CUDA GPU: {GPU_ONLY}")
def test_stripped_and_refittable_plans_build_where_a_gpu_is_visible(graph, store):
    """STRIP_PLAN leaves the weights out (a fraction of the full plan, refilled from the recorded graph); REFIT keeps
    them, refittable; each is its own key."""
    source = graph("tiny", "unet")
    full = rtx_build(source, store)
    stripped = rtx_build(source, store, strip_weights=True)
    refittable = rtx_build(source, store, refittable=True)
    assert len({full.key, stripped.key, refittable.key}) == 3
    check_plan(stripped, "fp16", 10_000)
    check_plan(refittable, "fp16", 5_000_000)
    assert stripped.primary.stat().st_size < full.primary.stat().st_size / 2
    assert stripped.manifest["weights"]["in_plan"] is False
    assert stripped.manifest["weights"]["refill_from"]["graph"] == source.primary.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
@pytest.mark.parametrize("option", ["--refittable", "--strip-weights"])
def test_without_a_gpu_refittable_and_stripped_plans_are_refused_before_any_export(graph, store, tmp_path, option):
    done = run_cli("compile", "--model", "tiny", "--target", "tensorrt-rtx", option, "--engines", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert (
        f"{option}: TensorRT-RTX {rtx_version()} builds refittable and weight-stripped plans only where a CUDA GPU"
        in done.stderr
    )
    assert not any(tmp_path.iterdir())
    with pytest.raises(MissingDependencyError, match=r"graph_jit\.cpp:278"):  # the library refuses before its worker
        rtx_build(graph("tiny", "text_encoder"), store, refittable=True)


def test_compute_capabilities_are_built_for_keyed_and_recorded(graph, store):
    source = graph("tiny", "text_encoder")
    default = rtx_build(source, store)
    turing = rtx_build(source, store, compute_capabilities=("7.5", "8.6"))
    assert turing.key != default.key
    details = check_plan(turing, "fp16", 1_000_000)
    assert details["compute_capabilities"] == ["7.5", "8.6"]
    assert turing.manifest["reproduce"].endswith("--compute-capability 7.5,8.6")


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_q_dq_unet_builds_with_its_quantize_layers(tiny, store, precision):
    """The quantize stage's TensorRT graph (fp16 outside its Q/DQ pairs), as NVIDIA's ModelOpt exports it: only
    Quantize layers of its own 8-bit type (ModelOpt's trt::TRT_FP8QuantizeLinear included)."""
    quantized = quantize.run(
        QuantizeConfig(precision=precision, calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2), tiny, store
    )
    plan = rtx_build(simplify.run(SimplifyConfig(), quantized, store), store)
    details = check_plan(plan, "fp16", 2_000_000)
    assert details["quantization"]["format"] == precision
    layers = details["quantization"]["quantize_layers"]
    assert layers.get(precision.upper(), 0) > 0 and set(layers) == {precision.upper()}
    assert details["layer_types"][precision.upper()] >= layers[precision.upper()]
    # TensorRT-RTX's default set (8.0 and later) narrowed to the GPUs that run the 8-bit format: FP8 needs 8.9.
    runnable = ["8.9", "12.0", "12.1"] if precision == "fp8" else DEFAULT_COMPUTE_CAPABILITIES
    assert details["compute_capabilities"] == runnable


TINY_PRESETS = [
    "tiny-sd2", "tiny-sdxl", "tiny-inpaint", "tiny-lcm", "tiny-controlnet", "tiny-sdxl-controlnet", "tiny-sd3",
    "tiny-flux",
    # 1-5 min each on 2 cores (klein's LLM encoder the longest), over the default suite's time: with -m slow; and
    # ~20 s each, the same kinds of layers as tiny-sdxl's and tiny-flux's: SDXL's refiner, FLUX.1 [schnell]
    *(pytest.param(p, marks=pytest.mark.slow) for p in ("tiny-flux-fill", "tiny-flux-control", "tiny-flux-kontext",
                                                         "tiny-flux-controlnet", "tiny-flux2-klein", "tiny-flux2",
                                                         "tiny-sdxl-refiner", "tiny-flux-schnell", "tiny-zimage",
                                                         "tiny-qwen-image", "tiny-qwen-image-edit")),
]  # fmt: skip


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_every_component_of_every_tiny_preset_builds(store, preset):
    """What `compile --target tensorrt-rtx` builds for each family (tiny itself: the CLI test below), each member at
    the precision compile gives it (fp16; VAEs and T5 fp32)."""
    from sdtrt.spec import model_components
    from sdtrt.tools.compile import compile_model

    model = resolve_model(preset)
    result = compile_model(model, store, "tensorrt-rtx")
    plans = [a for a in result.artifacts if a.stage == "build-trt"]
    assert [artifact_spec(p).component for p in plans] == list(model_components(model))
    for plan in plans:
        check_plan(plan, plan.manifest["io"]["precision"], 500_000)


def test_a_network_without_layers_of_the_graphs_precision_is_refused_in_one_line(graph, store, tmp_path):
    """What was built, not what was asked: an fp32 graph asked for as fp16 is refused by the worker after parsing
    (exit 2, its reason in the result file), never built into an fp32 plan (roboflow/rf-detr#1453)."""
    source = graph("tiny", "vae_decoder", "fp32")
    request = build_trt.worker_request(TrtBuildConfig(product="tensorrt-rtx"), source, tmp_path)
    assert request["precision"] == "fp32"
    request["precision"] = "fp16"
    (tmp_path / "request.json").write_text(json.dumps(request))
    done = subprocess.run(
        [sys.executable, "-m", "sdtrt.stages.trt_build_worker", str(tmp_path / "request.json")],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    refused = json.loads((tmp_path / "result.json").read_text())["refused"]
    assert "\n" not in refused and "no fp16 layer" in refused and "fp32" in refused and "--precision fp16" in refused
    assert not (tmp_path / "vae_decoder.plan").exists()


def test_the_compute_capabilities_sdtrt_names_are_the_modules_targets():
    import tensorrt_rtx as trt

    members = set(trt.ComputeCapability.__members__) - {"NONE", "CURRENT"}
    assert set(COMPUTE_CAPABILITIES.values()) == members


def trt_chains(source: str, root: str) -> set[str]:
    """Every ``root.A.B`` attribute chain in ``source`` (names, enum members), and ``Class.member`` for the attributes
    used on variables annotated ``root.Class``."""
    tree = ast.parse(source)
    chains, typed = set(), {}
    for node in ast.walk(tree):
        annotation = getattr(node, "annotation", None)
        target = getattr(node, "target", None) if isinstance(node, ast.AnnAssign) else node
        name = target.id if isinstance(target, ast.Name) else getattr(node, "arg", None)
        if name and isinstance(annotation, ast.Attribute) and ast.unparse(annotation).startswith(f"{root}."):
            typed[name] = ast.unparse(annotation).removeprefix(f"{root}.")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in typed:
            chains.add(f"{typed[node.value.id]}.{node.attr}")
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            text = ast.unparse(node)
            if text.startswith(f"{root}.") and "(" not in text:
                chains.add(text.removeprefix(f"{root}."))
    return chains


def test_every_name_the_shared_worker_runtime_and_rtx_differences_use_exists_in_tensorrt_rtx():
    """The worker runs under TensorRT-RTX for real in the tests above; this also covers the lines they do not reach
    (the timing cache is TensorRT's only, but its names are still bound in TensorRT-RTX 1.7) and the runtime, which
    needs an RTX GPU to run."""
    import tensorrt_rtx as trt

    sources = [
        (REPO / "sdtrt/stages/trt_build_worker.py", "trt"), (REPO / "sdtrt/core/trt_products.py", "rtx"),
        (REPO / "sdtrt/runtime/tensorrt.py", "trt"), (REPO / "sdtrt/runtime/rtx.py", "rtx"),
        *((path, "trt") for path in sorted((REPO / "sdtrt/runtime").glob("trt_*.py"))),
    ]  # fmt: skip
    chains = set().union(*(trt_chains(path.read_text(), root) for path, root in sources))
    missing = []
    for chain in sorted(chains):
        found = trt
        for part in chain.split("."):
            found = getattr(found, part, None)
        if found is None:
            missing.append(chain)
    assert missing == []
    assert len(chains) >= 25, sorted(chains)
    assert {"ComputeCapability", "IBuilderConfig.set_compute_capability", "BuilderFlag.STRIP_PLAN"} <= chains
    assert {"IRuntimeConfig.set_runtime_cache", "IRuntimeCache.deserialize", "CudaGraphStrategy.WHOLE_GRAPH_CAPTURE",
            "Runtime.get_engine_validity", "ICudaEngine.create_execution_context", "EngineValidity.SUBOPTIMAL",
            "IRuntimeConfig.set_execution_context_allocation_strategy", "ICudaEngine.device_memory_size_v2",
            "ExecutionContextAllocationStrategy.USER_MANAGED"} <= chains  # fmt: skip


def test_every_call_the_runtime_and_worker_make_fits_the_installed_tensorrt_rtx():
    """The datacenter checker (tests/trt_api.py check_source) with tensorrt_rtx itself in place of TensorRT's stubs:
    every name, every member used on a variable of a TensorRT-RTX class (``self._context`` included), and each call's
    arguments against the signatures pybind11 writes in the module's docstrings. The calls that give a TensorRT-RTX
    context the pipeline's shared activation buffer are among them, and a wrong one would be caught."""
    import tensorrt_rtx

    api = load_module_api(tensorrt_rtx)
    sources = [
        (REPO / "sdtrt/stages/trt_build_worker.py", "trt"), (REPO / "sdtrt/runtime/tensorrt.py", "trt"),
        (REPO / "sdtrt/runtime/rtx.py", "rtx"),
        *((path, "trt") for path in sorted((REPO / "sdtrt/runtime").glob("trt_*.py"))),
    ]  # fmt: skip
    problems, checked = [], 0
    for path, alias in sources:
        found, count = check_source(path.read_text(), api, alias)
        problems += [f"{path.name}: {p}" for p in found]
        checked += count
    assert problems == [] and checked >= 150, (problems, checked)

    runtime, rtx_source = (REPO / "sdtrt/runtime/tensorrt.py").read_text(), (REPO / "sdtrt/runtime/rtx.py").read_text()
    set_memory = "self._context.set_device_memory(buffer.data_ptr(), buffer.numel())"
    user_managed = "set_execution_context_allocation_strategy(rtx.ExecutionContextAllocationStrategy.USER_MANAGED)"
    wrong_calls = [  # (source, its alias, a call it makes, the same call made wrong, what the checker says of it)
        (runtime, "trt", set_memory, set_memory.replace(", buffer.numel()", ""), "misses 'size'"),
        (runtime, "trt", "engine.device_memory_size_v2", "engine.device_memory_size_v3", "has no member"),
        (rtx_source, "rtx", user_managed, user_managed.replace(")", ", 0)"), "takes 1 arguments, not 2"),
        (rtx_source, "rtx", "runtime.get_engine_validity(header)", "runtime.get_engine_validity()", "misses 'buffer'"),
    ]  # fmt: skip
    for source, alias, call, wrong, caught in wrong_calls:
        assert call in source
        assert caught in "\n".join(check_source(source.replace(call, wrong), api, alias)[0]), wrong


# ---- the command line: refusals before any export, then a whole compile --------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--compute-capability", "9.0"], "compute capability '9.0' is not one TensorRT-RTX builds for"),
        (["--timing-cache", "t.cache"], "--timing-cache needs a GPU at build time"),
        (["--optimization-level", "4"], "does no autotuning at build time"),
        # tiny's VAEs are fp32: TensorRT-RTX 1.7.1.116 fails their build for 7.5 ("FP32 GEMM is not supported").
        (["--compute-capability", "7.5"], "cannot build the vae_decoder as a TensorRT-RTX plan: TensorRT-RTX compiles"),
    ],
)
def test_options_an_rtx_build_cannot_take_are_refused_before_any_export(tmp_path, options, expected):
    done = run_cli("compile", "--model", "tiny", "--target", "tensorrt-rtx", *options, "--engines", str(tmp_path))
    assert done.returncode == 2 and expected in last_line(done.stderr)
    assert not [p for p in tmp_path.iterdir() if not p.name.startswith(".")]  # nothing exported (the store's .locks)


def test_a_failed_build_names_the_last_error_tensorrt_logged(tmp_path):
    from sdtrt.stages.build_trt import last_error

    log = tmp_path / "build.log"
    log.write_text(
        "[TRT] [I] parsing\n[TRT] [E] first\n[TRT] [E] IBuilder::buildSerializedNetwork: Error   Code 1\nTraceback"
    )
    assert last_error(log) == "IBuilder::buildSerializedNetwork: Error Code 1"
    log.write_text("[TRT] [I] no error logged\n")
    assert last_error(log) == ""


def test_compute_capabilities_are_refused_for_the_datacenter_target(tmp_path):
    done = run_cli("compile", "--target", "tensorrt", "--compute-capability", "8.6", "--engines", str(tmp_path))
    assert done.returncode == 2 and "use --target tensorrt-rtx" in last_line(done.stderr)


def test_the_target_without_tensorrt_rtx_is_refused_in_one_line(tmp_path):
    """A tensorrt_rtx that cannot be imported (as where its libraries are missing) shadows the installed one."""
    shadow = tmp_path / "shadow" / "tensorrt_rtx"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('libtensorrt_rtx.so: cannot open shared object file')\n")
    env = {"PYTHONPATH": f"{shadow.parent}:{REPO}"}
    done = run_cli("compile", "--target", "tensorrt-rtx", "--engines", str(tmp_path / "engines"), env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "pip install 'sdtrt[rtx]'" in done.stderr
    assert not (tmp_path / "engines").exists() or not any((tmp_path / "engines").iterdir())


def test_compile_tiny_builds_a_set_of_rtx_plans_and_validates_its_graphs_here():
    done = run_cli("compile", "--model", "tiny", "--target", "tensorrt-rtx", check=True)
    final = Path(last_line(done.stdout))
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["stage"] == "set"
    members = {i["component"]: i for i in manifest["inputs"]}
    assert set(members) == {"unet", "text_encoder", "vae_decoder", "vae_encoder"}
    for member in members.values():
        plan = Artifact.open(Path(member["path"]))
        assert plan.manifest["target"] == "tensorrt-rtx" and plan.primary.read_bytes()[:4] == b"vtrt"
    said = " ".join(done.stderr.split())  # the console wraps long lines
    assert "validated here: the graphs the plans were built from, on ONNX Runtime" in said
    assert "the TensorRT-RTX plans cannot run here (no CUDA GPU is visible to torch" in said
    assert "they validate on the first RTX GPU that runs them, `sdtrt validate" in said
    assert "unet b2 256x256 t=999" in said and "image vs PyTorch's: PSNR" in said  # the validation table
    skipped = run_cli("compile", "--model", "tiny", "--target", "tensorrt-rtx", "--no-validate", check=True)
    assert Path(last_line(skipped.stdout)) == final and "validate" not in skipped.stderr


# ---- the runtime: TensorRT's, with TensorRT-RTX's runtime config, runtime cache and validity check -----------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
def test_an_rtx_plan_is_refused_here_in_one_line_before_it_is_read(graph, store):
    from sdtrt.runtime import open_runtime

    plan = rtx_build(graph("tiny", "text_encoder"), store)
    with pytest.raises(MissingDependencyError, match="no CUDA GPU is visible") as caught:
        open_runtime(plan)
    assert "\n" not in str(caught.value) and "RTX-class GPUs of compute capability 8.0 or newer" in str(caught.value)


def test_the_runtime_cache_is_one_file_per_gpu_and_version_replaced_whole(tmp_path):
    """Two processes writing the store's runtime cache while a third reads it: every read is one writer's whole
    file, never a mix or a torn write, and no temporary file is left behind."""
    from sdtrt.core.locks import read_locked
    from sdtrt.runtime.rtx import cache_file

    path = cache_file(tmp_path, "NVIDIA GeForce RTX 4090", "8.9", "1.7.1.116")
    assert path == tmp_path / "runtime-cache" / "NVIDIA-GeForce-RTX-4090-sm8.9-tensorrt-rtx-1.7.1.116.cache"
    assert cache_file(tmp_path, "NVIDIA GeForce RTX 4090", "8.9", "1.8.0") != path
    assert read_locked(path) == b""
    writer = (
        "import sys; from pathlib import Path; from sdtrt.core.locks import replace_locked\n"
        "for i in range(40): replace_locked(Path(sys.argv[1]), bytes([int(sys.argv[2])]) * (1 << 20) * (1 + i % 3))\n"
    )
    writers = [
        subprocess.Popen([sys.executable, "-c", writer, str(path), str(n)], cwd=REPO) for n in (1, 2)
    ]  # fmt: skip
    seen = set()
    while any(w.poll() is None for w in writers):
        if data := read_locked(path):
            assert len(data) % (1 << 20) == 0 and len(set(data)) == 1
            seen.add(data[0])
    assert [w.wait() for w in writers] == [0, 0]
    assert seen <= {1, 2} and sorted(p.name for p in path.parent.iterdir()) == [f".{path.name}.lock", path.name]


def test_a_runtime_cache_whose_lock_cannot_be_made_is_still_read(tmp_path):
    """A read-only store: no lock file can be made beside the cache (here: a folder stands in its way, since root writes
    anywhere), so the cache is read without one instead of failing the plan's load."""
    from sdtrt.core.locks import read_locked
    from sdtrt.runtime.rtx import cache_file

    path = cache_file(tmp_path, "NVIDIA GeForce RTX 4090", "8.9", "1.7.1.116")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"kernels")
    path.with_name(f".{path.name}.lock").mkdir()
    assert read_locked(path) == b"kernels"


class HeaderRuntime:
    """tensorrt_rtx.Runtime's header check as its docstrings give it: engine_header_size, and
    get_engine_validity(buffer) returning (EngineValidity, a bitmask of EngineInvalidityDiagnostics)."""

    engine_header_size = 8

    def __init__(self, validity, diagnostics) -> None:
        self.answer, self.read = (validity, diagnostics), b""

    def get_engine_validity(self, buffer: bytes) -> tuple:
        self.read = buffer
        return self.answer


def test_a_plan_that_runs_below_its_best_here_says_so_in_one_line_and_an_invalid_one_is_refused(tmp_path, capsys):
    import tensorrt_rtx as trt

    from sdtrt.core.errors import EnvironmentMismatchError
    from sdtrt.runtime.rtx import check_validity

    plan = tmp_path / "unet.plan"
    plan.write_bytes(b"vtrt" + bytes(60))
    rebuild = "sdtrt build simplify/unet --target tensorrt-rtx --compute-capability 8.6"
    runtime = HeaderRuntime(trt.EngineValidity.VALID, 0)
    check_validity(trt, runtime, plan, rebuild)
    assert runtime.read == b"vtrt" + bytes(4) and capsys.readouterr().err == ""  # the header alone

    flags = int(trt.EngineInvalidityDiagnostics.UNSUPPORTED_CC)
    check_validity(trt, HeaderRuntime(trt.EngineValidity.SUBOPTIMAL, flags), plan, rebuild)
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and str(plan) in said and "UNSUPPORTED_CC" in said
    assert "below its best performance" in said and "--compute-capability list that includes this GPU's" in said
    assert f"`{rebuild}`" in said

    old_driver = HeaderRuntime(trt.EngineValidity.INVALID, trt.EngineInvalidityDiagnostics.OLD_CUDA_DRIVER)  # a flag
    with pytest.raises(EnvironmentMismatchError, match=r"cannot run .*\(OLD_CUDA_DRIVER\); update the NVIDIA driver$"):
        check_validity(trt, old_driver, plan, rebuild)  # a driver to update, not a plan to rebuild
    both = int(trt.EngineInvalidityDiagnostics.UNSUPPORTED_CC) | int(trt.EngineInvalidityDiagnostics.VERSION_MISMATCH)
    with pytest.raises(EnvironmentMismatchError) as refused:
        check_validity(trt, HeaderRuntime(trt.EngineValidity.INVALID, both), plan, rebuild)
    assert "(VERSION_MISMATCH, UNSUPPORTED_CC)" in str(refused.value) and str(refused.value).count(rebuild) == 2
    assert "this machine's TensorRT-RTX" in str(refused.value) and "holds this GPU's" in str(refused.value)


@pytest.mark.parametrize(
    ("here", "details", "problem"),
    [
        ("8.6", {"compute_capabilities": "TensorRT-RTX's default"}, None),
        ("7.5", {"compute_capabilities": "TensorRT-RTX's default"}, "has compute capability 7.5, and the plan was"),
        ("8.9", {"compute_capabilities": ["8.6", "12.0"]}, "built for 8.6, 12.0"),
        ("8.6", {"compute_capabilities": ["8.6"], "quantization": {"format": "int8"}}, None),
        ("8.6", {"compute_capabilities": ["8.9", "12.0", "12.1"], "quantization": {"format": "fp8"}}, "built for 8.9"),
        ("8.6", {"compute_capabilities": "TensorRT-RTX's default", "quantization": {"format": "fp8"}}, "FP8 engines"),
    ],
)
def test_a_gpu_that_cannot_run_a_plan_is_named_before_its_load(monkeypatch, here, details, problem):
    """What the plan's manifest says it was built for against this GPU: compile validates the graphs instead (an FP8
    plan on an 8.6 GPU, whose rebuild for 8.6 the build refuses), and the runtime refuses it in one line."""
    from sdtrt.core import gpu
    from sdtrt.core.trt_products import rtx_gpu_problem

    monkeypatch.setattr(gpu, "gpu_environment", lambda: {"gpu": "NVIDIA GeForce RTX 3090", "compute_capability": here})
    found = rtx_gpu_problem(details)
    assert found is None if problem is None else problem in found


class RecordingConfig:
    """tensorrt_rtx.IRuntimeConfig's calls that RuntimeCache makes, recorded (a stand-in: a real one needs an engine,
    which needs an RTX GPU). Returns what the docstrings say: set_runtime_cache a bool, the strategy setter None."""

    def __init__(self) -> None:
        self.strategy, self.cuda_graph_strategy, self.cache = None, None, None

    def set_execution_context_allocation_strategy(self, strategy) -> None:
        self.strategy = strategy

    def create_runtime_cache(self):
        return SimpleNamespace(deserialize=lambda data: True, serialize=lambda: b"kernels")

    def set_runtime_cache(self, cache) -> bool:
        self.cache = cache
        return True


@pytest.mark.parametrize(("user_managed", "cuda_graph"), [(False, False), (True, False), (False, True)])
def test_a_context_that_takes_the_shared_buffer_is_configured_user_managed(tmp_path, user_managed, cuda_graph):
    """A TensorRT-RTX context in a pipeline gets no memory of its own (USER_MANAGED, set on its runtime config before
    the context is made); one alone keeps TensorRT-RTX's default, and CUDA graphs are TensorRT-RTX's own either way."""
    import tensorrt_rtx as trt

    from sdtrt.runtime.rtx import RuntimeCache

    config = RecordingConfig()
    engine = SimpleNamespace(create_runtime_config=lambda: config)
    cache = RuntimeCache(trt, engine, tmp_path / f"{user_managed}-{cuda_graph}.cache", cuda_graph, user_managed)
    assert cache.config is config and config.cache is cache.cache
    assert config.strategy == (trt.ExecutionContextAllocationStrategy.USER_MANAGED if user_managed else None)
    assert config.cuda_graph_strategy == (trt.CudaGraphStrategy.WHOLE_GRAPH_CAPTURE if cuda_graph else None)


def test_a_parser_failure_with_no_recorded_error_is_refused_in_one_line():
    """onnx-tensorrt may only log a failure: parse_from_file returns False with num_errors 0, and get_error(0) is then
    None (the parser stands in for TensorRT's OnnxParser with no error recorded)."""
    from sdtrt.stages.trt_build_worker import Refused, parser_refusal

    refusal = parser_refusal(SimpleNamespace(num_errors=0, get_error=lambda index: None), "unet")  # type: ignore[arg-type]
    assert isinstance(refusal, Refused) and "recorded no error; see the build log" in str(refusal)


@pytest.mark.skipif(bool(rtx_runtime_missing()), reason=f"runs an RTX plan: {rtx_runtime_missing()}")
def test_an_rtx_plan_runs_like_pytorch_and_leaves_its_runtime_cache(tiny, graph, store):
    from sdtrt.runtime import open_runtime
    from sdtrt.runtime.rtx import store_cache_file
    from sdtrt.sources.models import load_unet
    from sdtrt.spec import ValidationCase
    from sdtrt.tools.validate import compare_case

    plan = rtx_build(graph("tiny", "unet"), store)
    for _ in range(2):  # the second load starts from the runtime cache the first left
        runtime = open_runtime(plan, cuda_graph=True)
        row = compare_case(runtime, load_unet(tiny), runtime.spec, ValidationCase(2, 256, 256, 999.0, 0))
        runtime.close()
        assert row["finite"] and row["cosine"] >= 0.99
        assert store_cache_file(plan.primary).stat().st_size > 0


@pytest.mark.skipif(bool(rtx_runtime_missing()), reason=f"runs RTX plans: {rtx_runtime_missing()}")
def test_the_rtx_plans_of_a_pipeline_share_one_activation_buffer(tiny, graph, store):
    """As the TensorRT plans of a set do (tests/test_gpu.py): one buffer of the largest member's device_memory_size_v2,
    contexts USER_MANAGED from their runtime config, each member computing what it computes alone after the other has
    overwritten the buffer. A plan opened with TensorRT-RTX's own CUDA graphs keeps its own memory. Compared within a
    tolerance: TensorRT-RTX may run a fallback kernel until its shape-specialized one is compiled (LAZY)."""
    from sdtrt.runtime import open_members, open_runtime

    sources = {"text_encoder": graph("tiny", "text_encoder"), "vae_decoder": graph("tiny", "vae_decoder", "fp32")}
    members = {c: rtx_build(source, store) for c, source in sources.items()}
    shared = open_members(members, tiny)
    alone = {c: open_runtime(a, tiny) for c, a in members.items()}
    with_graphs = open_runtime(
        members["vae_decoder"], tiny, cuda_graph=True, device_memory=shared["vae_decoder"]._shared
    )
    pool = shared["vae_decoder"]._shared
    assert pool is not None and all(r._shared is pool for r in shared.values()) and alone["vae_decoder"]._shared is None
    assert pool.needed == max(int(r._engine.device_memory_size_v2) for r in shared.values())
    assert with_graphs._shared is None
    feeds = {
        c: r.spec.case_inputs(r.spec.validation_cases(artifact_spec(sources[c]).default_profile())[0])
        for c, r in shared.items()
    }
    expected = {c: r.run(feeds[c]) for c, r in alone.items()}
    for _ in range(2):
        for component, runtime in shared.items():
            got = runtime.run(feeds[component])
            for name, want in expected[component].items():
                error = (got[name].float() - want.float()).abs().max().item()
                assert error <= 1e-2 * want.float().abs().max().item() + 1e-3, (component, name, error)
    assert pool.generation == 1
    for runtime in [*shared.values(), *alone.values(), with_graphs]:
        runtime.close()


@pytest.mark.slow
def test_the_qwen_vl_vision_tower_builds_as_a_plan(store, tmp_path):
    """Qwen2.5-VL's vision tower (tests/test_qwen_vision.py's two-block tower) at the precision compile gives it, bf16
    (fp16 overflows in Qwen's models), over its default profile: up to 1064×1064 pixels, 5776 patches."""
    from .test_qwen_vision import vision_folder

    source, _ = vision_folder(tmp_path)
    exported = export.run(ExportConfig(precision="bf16", component="vision_encoder"), source, store)
    plan = rtx_build(simplify.run(SimplifyConfig(), exported, store), store)
    details = check_plan(plan, "bf16", 100_000)
    assert details["compute_capabilities"] == DEFAULT_COMPUTE_CAPABILITIES
