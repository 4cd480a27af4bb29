"""8-bit engines (issue 22): the TensorRT build of Q/DQ graphs, its refusals, and LoRAs on quantized engines.

The capability rule and the optimization level are pure functions, checked here without a GPU; the builds
themselves are `gpu` tests (skipped where CUDA or TensorRT is missing).
"""

from __future__ import annotations

import pytest

from sdtrt.core.config import DEFAULT_PROMPT, QuantizeConfig, TrtBuildConfig, default_optimization_level
from sdtrt.core.errors import LoraError
from sdtrt.core.gpu import quantization_problem
from sdtrt.graph.onnx_graph import artifact_spec
from sdtrt.pipeline.loading import load_pipeline
from sdtrt.spec import FluxTransformerSpec
from sdtrt.stages import build_trt, quantize
from sdtrt.tools.compile import build

from .helpers import peft_lora, run_cli


@pytest.mark.parametrize(
    ("precision", "capability", "refused"),
    [
        ("fp8", "8.6", True),  # Ampere (A10, RTX 30xx): no FP8 Tensor Cores
        ("fp8", "8.0", True),
        ("fp8", "8.9", False),  # Ada (L4, L40S, RTX 40xx)
        ("fp8", "9.0", False),  # Hopper
        ("fp8", "12.0", False),  # Blackwell: a two-digit major compares as a number, not as text
        ("int8", "7.0", True),  # Volta
        ("int8", "7.5", False),  # Turing
        ("int8", "8.6", False),
    ],
)
def test_8bit_engines_need_their_compute_capability(precision, capability, refused):
    problem = quantization_problem(precision, capability, "NVIDIA X")
    assert (problem is not None) == refused
    if refused:
        assert "\n" not in problem
        need = "8.9" if precision == "fp8" else "7.5"
        assert f"{precision.upper()} engines need a GPU of compute capability {need} or newer" in problem
        assert f"NVIDIA X has {capability}" in problem and "use --precision" in problem


def test_q_dq_graphs_build_at_level_4_as_nvidia_builds_them_unless_flux():
    """Review 4, S3: demo dd_argparse.py sets 4 for `int8 or fp8 and not is_flux`: an FP8 SD3.5 Large (8 B) gets 4,
    only Flux keeps 3 (for GPU memory), whatever the size."""
    assert default_optimization_level(900_000_000, "int8")[0] == 4
    assert "FP8 Q/DQ: level 4" in default_optimization_level(900_000_000, "fp8")[1]
    assert default_optimization_level(900_000_000)[0] == 3
    assert default_optimization_level(8_100_000_000, "fp8", "SD3Transformer2DModel")[0] == 4
    level, why = default_optimization_level(12_000_000_000, "fp8", FluxTransformerSpec.architecture)
    assert level == 3 and "Flux" in why
    assert default_optimization_level(1_000_000, "int8", FluxTransformerSpec.architecture)[0] == 3  # tiny Flux too


# ---- with a real quantized UNet: ModelOpt FP8 on tiny, two graphs (a minute on two cores) ------------------------


@pytest.fixture(scope="module")
def fp8_unet(tiny, store):
    config = QuantizeConfig(precision="fp8", calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2)
    return quantize.run(config, tiny, store)


@pytest.fixture(scope="module")
def fp8_engine(fp8_unet, store):
    return build(fp8_unet, store, "onnxruntime")[0]


def test_tensorrt_builds_the_quantize_artifacts_tensorrt_graph(fp8_unet, tmp_path):
    """The manifest's TensorRT graph (16-bit outside its Q/DQ pairs, ModelOpt's trt:: FP8 ops kept where there are
    any), never the primary ONNX Runtime graph, built at builder optimization level 4 as NVIDIA builds 8-bit graphs."""
    request = build_trt.worker_request(TrtBuildConfig(), fp8_unet, tmp_path)
    assert request["onnx"] == str(fp8_unet.path / fp8_unet.manifest["graphs"]["tensorrt"])
    assert request["quantization"] == "fp8" and request["optimization_level"] == 4
    assert "FP8 Q/DQ: level 4" in build_trt.resolved(TrtBuildConfig(), fp8_unet)[1]


def test_the_tensorrt_graph_is_read_as_fp16_from_every_artifact_made_from_it(fp8_unet, fp8_engine, tmp_path):
    """The TensorRT graph is fp16 outside its Q/DQ pairs where ONNX Runtime's is fp32: the build reads that graph's
    contract (its engine's IO and TF32 follow an fp16 graph), from the quantize artifact or any later one, and the
    report names the graph that ran."""
    assert build_trt.worker_request(TrtBuildConfig(), fp8_unet, tmp_path)["onnx"].endswith("unet.trt.onnx")
    for artifact in (fp8_unet, fp8_engine):
        assert artifact_spec(artifact).precision == "fp32"  # ONNX Runtime's graph, the primary
        assert quantize.tensorrt_spec(artifact).precision == "fp16"
        assert build_trt.resolved(TrtBuildConfig(), artifact)[0].tf32 is True  # as for any fp16 graph
        # What runs it on the CPU is ONNX Runtime's graph, and the report says so.
        assert quantize.precision_label(artifact) == "fp8 level 2.5 (ONNX Runtime graph, fp32 outside Q/DQ)"


def test_a_lora_on_a_quantized_engine_is_refused_in_one_line(tiny, fp8_engine, tmp_path):
    lora = peft_lora(tiny, tmp_path / "lora", seed=1, rank=4, alpha=4)
    pipe = load_pipeline(tiny, fp8_engine)
    with pytest.raises(LoraError, match=r"quantized to FP8.*fuse the LoRA into the model first and quantize") as caught:
        pipe.unet.set_loras([(lora, 1.0)])
    assert "\n" not in str(caught.value) and pipe.unet.loras.active == []
    refused = run_cli("lora", "inspect", lora, "--engine", str(fp8_engine.path))
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0
    assert "LoRAs cannot change a quantized engine" in refused.stderr


# ---- on a GPU with TensorRT (skipped elsewhere): one strongly typed build per 8-bit format ----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_quantized_unet_builds_strongly_typed_and_matches_pytorch(tiny, store, precision):
    """Below the format's compute capability the build is refused before it starts; else the plan quantizes to
    that type (the worker counts the parsed network's Quantize layers) and its output follows fp32 PyTorch."""
    from sdtrt.core.config import Range, ShapeProfile
    from sdtrt.core.errors import MissingDependencyError
    from sdtrt.core.gpu import gpu_environment
    from sdtrt.runtime import open_runtime
    from sdtrt.sources.models import load_unet
    from sdtrt.spec import ValidationCase
    from sdtrt.tools.validate import compare_case

    quantized = quantize.run(
        QuantizeConfig(precision=precision, calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2), tiny, store
    )
    profile = ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384))
    trt_config = TrtBuildConfig(profiles=(profile,))
    env = gpu_environment()
    if problem := quantization_problem(precision, env["compute_capability"], env["gpu"]):
        with pytest.raises(MissingDependencyError, match="compute capability"):
            build(quantized, store, "tensorrt", trt_config=trt_config)
        pytest.skip(problem)
    engine, _ = build(quantized, store, "tensorrt", trt_config=trt_config)
    details = engine.manifest["details"]
    assert details["quantization"]["format"] == precision
    assert details["quantization"]["quantize_layers"].get(precision.upper(), 0) > 0
    assert details["optimization_level"]["level"] == 4
    assert engine.manifest["io"]["precision"] == "fp16"  # the TensorRT graph's, fp16 outside its Q/DQ pairs
    runtime = open_runtime(engine)
    row = compare_case(runtime, load_unet(tiny), runtime.spec, ValidationCase(2, 256, 256, 999.0, 0))
    assert row["finite"] and row["cosine"] >= 0.99
