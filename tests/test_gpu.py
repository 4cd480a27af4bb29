"""TensorRT end to end on a GPU: build the tiny engine once, run it, wrap it, validate it.

Marked `gpu`: skipped with the reason where CUDA, TensorRT or torch-tensorrt is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdtrt.core.artifact import MANIFEST, Artifact
from sdtrt.core.config import (
    ExportConfig,
    Range,
    ShapeProfile,
    SimplifyConfig,
    TrtBuildConfig,
    WeightBudget,
    WrapConfig,
)
from sdtrt.core.errors import ArtifactError, EngineInputError, EnvironmentMismatchError, RequestError
from sdtrt.runtime import check_weight_budget, open_runtime
from sdtrt.sources.models import load_unet
from sdtrt.spec import ValidationCase
from sdtrt.stages import export, simplify, wrap
from sdtrt.tools.compile import build, compile_model
from sdtrt.tools.validate import ValidationConfig, compare_case, validate

pytestmark = pytest.mark.gpu

PROFILE = ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384))


@pytest.fixture(scope="session")
def trt_engine(tiny_simplified, store):
    engine, reason = build(tiny_simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,)))
    assert reason == "tensorrt: requested"
    return engine


@pytest.fixture(scope="session")
def reference_unet(tiny):
    return load_unet(tiny).cuda()


@pytest.fixture(scope="session")
def reference_cpu(tiny):
    """A CPU fp32 copy for compare_case, so no test moves the shared CUDA reference."""
    return load_unet(tiny)


def test_manifest_records_tensorrt_and_gpu(trt_engine):
    env = trt_engine.manifest["environment"]
    assert env["tensorrt"] != "absent" and env["compute_capability"].count(".") == 1
    assert trt_engine.primary.stat().st_size > 0


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_engine_matches_pytorch(trt_engine, reference_cpu, cuda_graph):
    runtime = open_runtime(trt_engine, cuda_graph=cuda_graph)
    for case in (ValidationCase(2, 256, 256, 999.0, 0), ValidationCase(4, 128, 384, 1.0, 1)):
        first = compare_case(runtime, reference_cpu, runtime.spec, case)
        again = compare_case(runtime, reference_cpu, runtime.spec, case)  # replays the graph
        assert first["cosine"] >= 0.999 and again == first


def test_cuda_graph_replays_an_older_shape_after_a_newer_capture(trt_engine):
    """Issue 9, item 2: a graph must never replay against context state bound for another shape."""
    graphed, eager = open_runtime(trt_engine, cuda_graph=True), open_runtime(trt_engine)
    small, large = (graphed.spec.sample_inputs(b, h, w, seed=s) for b, h, w, s in ((2, 256, 256, 0), (4, 128, 384, 1)))
    for feeds in (small, large, small, large):
        got = graphed.run(feeds)["out_sample"].float()
        expected = eager.run(feeds)["out_sample"].float()
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-3)


def test_the_runtime_runs_on_its_own_stream(trt_engine):
    """Issue 9, item 3: never the legacy default stream, and the caller's stream sees the result in order."""
    runtime = open_runtime(trt_engine)
    assert runtime._stream != torch.cuda.default_stream()
    feeds = runtime.spec.sample_inputs(2, 256, 256)
    out = runtime.run(feeds)["out_sample"]
    assert torch.isfinite(out).all()  # read on the caller's stream, after it waited for the runtime's


def test_out_of_profile_request_names_the_profiles(trt_engine):
    runtime = open_runtime(trt_engine)
    feeds = runtime.spec.sample_inputs(2, 512, 512)
    with pytest.raises(EngineInputError, match=r"outside every optimization profile .*profile 0"):
        runtime.run(feeds)


def copy_from_another_gpu(engine: Artifact, tmp_path) -> Path:
    """A copy of ``engine`` whose manifest says it was built on a compute capability 5.0 GPU."""
    import shutil

    copy = tmp_path / "engine"
    shutil.copytree(engine.path, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["environment"]["compute_capability"] = "5.0"
    (copy / MANIFEST).write_text(json.dumps(manifest))
    return copy


def test_engine_from_another_gpu_is_refused(trt_engine, tmp_path):
    copy = copy_from_another_gpu(trt_engine, tmp_path)
    with pytest.raises(EnvironmentMismatchError, match=r"compute capability 5\.0"):
        open_runtime(Artifact.open(copy))


def test_torchscript_round_trip(trt_engine, store, reference_unet):
    import torch_tensorrt  # noqa: F401

    wrapped = wrap.run(WrapConfig(), trt_engine, store)
    module = torch.jit.load(str(wrapped.primary))
    spec = open_runtime(trt_engine).spec
    feeds = spec.sample_inputs(2, 256, 256)
    inputs = [feeds[n].cuda().to(torch.float16 if n != "timestep" else torch.float32) for n in spec.input_names]
    out = module(*inputs)  # one tensor argument per engine input; one output comes back as a tensor
    assert isinstance(out, torch.Tensor)
    expected = reference_unet(*(feeds[n].cuda() for n in spec.input_names), return_dict=False)[0]
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), expected.flatten(), dim=0) > 0.999


def test_compile_tensorrt_validates_the_wrapped_engine(tiny, store):
    result = compile_model(
        tiny, store, "tensorrt", profile=PROFILE, validation=ValidationConfig(steps=4), components=("unet",)
    )
    assert [a.stage for a in result.artifacts] == ["export", "simplify", "build-trt", "wrap"]
    assert result.validation, result.validation.failures
    assert validate(tiny, result.artifacts[2], ValidationConfig(steps=4))


def test_an_engine_with_two_profiles_is_kept_unwrapped(tiny, tiny_simplified, store):
    """Issue 9, item 6: Torch-TensorRT's TRTEngine only ever runs profile 0."""
    wide = ShapeProfile(Range(1, 1, 2), Range(384, 512, 768), Range(384, 512, 768))
    config = TrtBuildConfig(profiles=(PROFILE, wide))
    engine, _ = build(tiny_simplified, store, "tensorrt", trt_config=config)
    with pytest.raises(ArtifactError, match="2 optimization profiles"):
        wrap.run(WrapConfig(), engine, store)
    runtime = open_runtime(engine)
    assert runtime.run(runtime.spec.sample_inputs(2, 512, 512))["out_sample"].shape == (2, 4, 64, 64), "profile 1"
    result = compile_model(tiny, store, "tensorrt", profile=PROFILE, trt_config=config, components=("unet",))
    assert result.final.stage == "build-trt" and "not wrapped as TorchScript" in result.target_reason


# ---- issue 10: every component on TensorRT ------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["text_encoder", "vae_decoder", "vae_encoder"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_component_engines_match_onnx_runtime(tiny, store, component, cuda_graph):
    """Several outputs (the text encoder's three), int32 token ids and fp32 VAEs bind and run."""
    from sdtrt.tools.compile import component_precision

    config = ExportConfig(component=component, precision=component_precision(tiny, component, "fp16"))
    simplified = simplify.run(SimplifyConfig(), export.run(config, tiny, store), store)
    engine, _ = build(simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,)))
    assert engine.primary.name == f"{component}.plan"
    runtime, reference = open_runtime(engine, cuda_graph=cuda_graph), open_runtime(simplified)
    for batch, height, width, seed in ((1, 256, 256, 0), (2, 128, 384, 1)):
        feeds = runtime.spec.sample_inputs(batch, height, width, seed=seed)
        got, expected = runtime.run(feeds), reference.run(feeds)
        assert list(got) == list(runtime.spec.output_names)
        for name, value in got.items():
            assert value.dtype == expected[name].dtype and value.shape == expected[name].shape, name
            similarity = torch.nn.functional.cosine_similarity(
                value.float().cpu().flatten(), expected[name].float().flatten(), dim=0
            )
            assert similarity > 0.999, (name, float(similarity))


def test_compile_tensorrt_builds_validates_and_generates_with_the_whole_set(tiny, store):
    from sdtrt.pipeline.loading import load_pipeline

    result = compile_model(tiny, store, "tensorrt", profile=PROFILE, validation=ValidationConfig(steps=4))
    assert result.final.stage == "set"
    assert sorted(a.primary.name for a in result.artifacts if a.stage == "wrap") == [
        "text_encoder.ts", "unet.ts", "vae_decoder.ts", "vae_encoder.ts"
    ]  # fmt: skip
    assert result.validation, result.validation.failures
    pipe = load_pipeline(tiny, engine=result.final)
    assert type(pipe.text_encoder).__name__ == "EngineTextEncoder" and type(pipe.vae).__name__ == "EngineVAE"
    image = pipe("a cat", num_inference_steps=2, height=256, width=256, output_type="np").images[0]
    assert image.shape == (256, 256, 3) and float(image.std()) > 0


# ---- issue 11: every family on TensorRT ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-sd2", "tiny-sdxl", "tiny-sdxl-refiner", "tiny-inpaint", "tiny-lcm"])
def test_every_family_builds_and_validates_on_tensorrt(store, preset):
    from sdtrt.sources.models import resolve_model

    result = compile_model(resolve_model(preset), store, "tensorrt", validation=ValidationConfig(steps=4))
    assert result.final.stage == "set" and result.validation, result.validation.failures


# ---- issue 24: runtime, build, wrap and debug defects ------------------------------------------------------------


def test_a_refused_request_does_not_poison_the_captured_shape(trt_engine):
    """Item 2: capture, send an out-of-profile request, then repeat the first shape."""
    graphed, eager = open_runtime(trt_engine, cuda_graph=True), open_runtime(trt_engine)
    small = graphed.spec.sample_inputs(2, 256, 256)
    first = graphed.run(small)["out_sample"]
    with pytest.raises(EngineInputError, match="outside every optimization profile"):
        graphed.run(graphed.spec.sample_inputs(2, 512, 512))
    again = graphed.run(small)["out_sample"]  # re-captured, never an assert
    assert torch.equal(again, first) and torch.allclose(
        again.float(), eager.run(small)["out_sample"].float(), atol=1e-3
    )


def test_an_fp32_engine_computes_in_fp32(tiny, store):
    """Item 3: an fp32 VAE is built without TF32 (keyed so), and matches ONNX Runtime fp32 to fp32 tolerances."""
    config = ExportConfig(component="vae_decoder", precision="fp32")
    simplified = simplify.run(SimplifyConfig(), export.run(config, tiny, store), store)
    engine, _ = build(simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,)))
    assert engine.manifest["config"]["tf32"] is False and "--no-tf32" in engine.manifest["reproduce"]
    runtime, reference = open_runtime(engine), open_runtime(simplified)
    feeds = runtime.spec.sample_inputs(1, 256, 256)
    (name,) = runtime.spec.output_names
    got, expected = runtime.run(feeds)[name].float().cpu(), reference.run(feeds)[name].float()
    assert float((got - expected).abs().max()) < 1e-3


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_refittable_engine_refits_a_b_a_bit_exact(tiny, store, tmp_path, precision):
    """Item 7: build with --refittable, refit LoRA A, then B, then A again: A's output bit for bit. Review 4, M1:
    a bf16 engine too (its weight map matched in bf16, its LoRA weights computed through their bits)."""
    from sdtrt.pipeline.loading import load_pipeline

    from .helpers import peft_lora

    simplified = simplify.run(SimplifyConfig(), export.run(ExportConfig(precision=precision), tiny, store), store)
    engine, _ = build(simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,), refittable=True))
    assert "--refittable" in engine.manifest["reproduce"]
    pipe = load_pipeline(tiny, engine)
    a = peft_lora(tiny, tmp_path / "a", seed=1, rank=4, alpha=8)
    b = peft_lora(tiny, tmp_path / "b", seed=2, rank=2, alpha=1)
    feeds = pipe.unet.runtime.spec.sample_inputs(2, 256, 256)

    def out() -> torch.Tensor:
        return pipe.unet.runtime.run(feeds)["out_sample"].clone()

    base = out()
    pipe.unet.set_loras([(a, 0.8)])
    with_a = out()
    pipe.unet.set_loras([(b, 1.0)])
    with_b = out()
    pipe.unet.set_loras([(a, 0.8)])
    assert torch.equal(out(), with_a) and not torch.equal(with_a, with_b) and not torch.equal(with_a, base)
    pipe.unet.clear_loras()
    assert torch.equal(out(), base)


def test_debug_runs_on_a_tensorrt_engine(trt_engine):
    """Item 7: `sdtrt debug` rebuilds the engine's graph with every tensor an output, TF32 as the engine has it."""
    import math

    from sdtrt.tools.debug import debug

    report = debug(trt_engine)
    assert report.backend == "tensorrt" and report.compared > 10 and math.isfinite(report.largest_error)


def test_debug_rebuilds_the_tensorrt_graph_of_a_quantized_engine(tiny, store):
    """A quantized plan is parsed from the quantize stage's TensorRT graph (fp16 outside its Q/DQ pairs, as the
    engine's IO), not the fp32 ONNX Runtime graph that is its source's primary: debug rebuilds that graph and feeds it
    the engine's own fp16 inputs."""
    import math

    from sdtrt.core.config import DEFAULT_PROMPT, QuantizeConfig
    from sdtrt.stages import quantize
    from sdtrt.tools.debug import debug

    config = QuantizeConfig(precision="int8", calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2)
    engine, _ = build(
        quantize.run(config, tiny, store), store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,))
    )
    assert engine.manifest["details"]["worker_request"]["onnx"].endswith("unet.trt.onnx")
    report = debug(engine)
    assert report.backend == "tensorrt" and report.compared > 10 and math.isfinite(report.largest_error)


def test_wrap_refuses_an_engine_from_another_gpu(trt_engine, store, tmp_path):
    """Item 6: not torch-tensorrt's "Unable to deserialize", but what differs and the command that rebuilds it."""
    copy = copy_from_another_gpu(trt_engine, tmp_path)
    with pytest.raises(EnvironmentMismatchError, match=r"compute capability 5\.0.*sdtrt build .* --optimization-level"):
        wrap.run(WrapConfig(), Artifact.open(copy), store)


def test_the_torchscript_runtime_keeps_its_gpu_and_drains_on_close(trt_engine, store):
    """Item 6: the wrapped engine runs on the device it was loaded on, and close() waits for its work."""
    runtime = open_runtime(wrap.run(WrapConfig(), trt_engine, store))
    assert runtime.device == torch.device("cuda", torch.cuda.current_device())
    out = runtime.run(runtime.spec.sample_inputs(2, 256, 256))["out_sample"]
    runtime.close()
    assert out.device == runtime.device and torch.isfinite(out).all()


# ---- issue 20: bf16 networks, weight streaming, the transformer families -----------------------------------------


@pytest.fixture(scope="session")
def bf16_unet(tiny, store):
    simplified = simplify.run(SimplifyConfig(), export.run(ExportConfig(precision="bf16"), tiny, store), store)
    engine, _ = build(simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,)))
    return engine


def test_a_bf16_engine_builds_and_matches_pytorch(bf16_unet, reference_cpu):
    """Strongly typed bf16: bfloat16 IO, Resize computed in fp32, held to bf16's tolerances."""
    from sdtrt.tools.validate import Tolerances, check_tensor_row

    runtime = open_runtime(bf16_unet)
    assert runtime.dtype == torch.bfloat16 and bf16_unet.manifest["config"]["tf32"] is True
    row = compare_case(runtime, reference_cpu, runtime.spec, ValidationCase(2, 256, 256))
    assert check_tensor_row(row, Tolerances.for_precision("bf16"), "UNet") == []


def test_a_bf16_engine_refits_with_bf16_weights(tiny, store):
    """ONNX gives bf16 initializers as ml_dtypes' bfloat16, which trt.Weights(array) refuses (python/src/utils.cpp
    ``type``): the refit passes them by pointer. Refitting a conv kernel with its own value changes nothing."""
    import onnx

    from sdtrt.graph.graph_weights import read_named_initializers

    simplified = simplify.run(SimplifyConfig(), export.run(ExportConfig(precision="bf16"), tiny, store), store)
    config = TrtBuildConfig(profiles=(PROFILE,), refittable=True)
    engine, _ = build(simplified, store, "tensorrt", trt_config=config)
    graph = onnx.load(str(simplified.primary), load_external_data=False).graph
    kernel = next(i.name for i in graph.initializer if i.data_type == onnx.TensorProto.BFLOAT16 and len(i.dims) == 4)
    runtime = open_runtime(engine)
    feeds = runtime.spec.case_inputs(ValidationCase(2, 256, 256))
    before = runtime.run(feeds)["out_sample"].clone()
    runtime.set_weights(read_named_initializers(simplified.primary, {kernel}))
    assert torch.equal(runtime.run(feeds)["out_sample"], before)


def test_a_weight_streaming_engine_runs_within_a_budget(tiny, tiny_simplified, store):
    from sdtrt.runtime.tensorrt import TensorRTRuntime

    config = TrtBuildConfig(profiles=(PROFILE,), weight_streaming=True)
    engine, _ = build(tiny_simplified, store, "tensorrt", trt_config=config)
    assert engine.manifest["config"]["weight_streaming"] is True
    feeds = ValidationCase(2, 256, 256)
    full = open_runtime(engine)
    expected = full.run(full.spec.case_inputs(feeds))["out_sample"]
    for budget in ("0", "50%", "auto"):
        streamed = open_runtime(engine, weight_budget=WeightBudget.parse(budget))
        assert torch.equal(streamed.run(streamed.spec.case_inputs(feeds))["out_sample"], expected)
        streamed.close()
    plain, _ = build(tiny_simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,)))
    with pytest.raises(ArtifactError, match="built without weight streaming"):
        TensorRTRuntime(
            plain.primary, open_runtime(plain).spec, plain.manifest, weight_budget=WeightBudget.parse("50%")
        )
    with pytest.raises(RequestError, match="none of these was"):
        check_weight_budget([plain], WeightBudget.parse("50%"))


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_transformer_family_builds_and_validates_on_tensorrt(store, preset, precision):
    """Runs once the transformer families land (issue 20 items 1-5); skips while their presets do not exist."""
    from sdtrt.core.errors import SdtrtError
    from sdtrt.sources.models import resolve_model

    try:
        model = resolve_model(preset)
    except SdtrtError as exc:
        pytest.skip(f"{preset} is not available yet: {exc}")
    result = compile_model(
        model, store, "tensorrt", ExportConfig(precision=precision), validation=ValidationConfig(steps=4),
        trt_config=TrtBuildConfig(weight_streaming=True),
    )  # fmt: skip
    assert result.final.stage == "set" and result.validation, result.validation.failures
    transformer = next(a for a in result.artifacts if a.stage == "build-trt" and "transformer" in a.primary.name)
    assert transformer.manifest["details"]["optimization_level"]["level"] == 3


@pytest.mark.parametrize(("precision", "level"), [("int8", 2.5), ("fp8", 3.0)])
def test_a_quantized_flux_transformer_builds_in_bf16_and_runs_on_bfloat16_buffers(store, precision, level):
    """Flux's TensorRT Q/DQ graph is bf16 outside its Q/DQ pairs (quantize.tensorrt_precision), its scales bf16 too
    (a 16-bit scale must be of its input's type, NvInfer.h IQuantizeLayer): the strongly typed plan parses Quantize
    layers of the format, takes and gives torch.bfloat16 (fp32 for the timestep, positions and guidance), and its
    stand-in follows the fp32 pipeline to 8-bit tolerances."""
    from sdtrt.core.config import DEFAULT_PROMPT, QuantizeConfig
    from sdtrt.core.gpu import gpu_environment, quantization_problem
    from sdtrt.sources.models import resolve_model
    from sdtrt.stages import quantize

    env = gpu_environment()
    if problem := quantization_problem(precision, env["compute_capability"], env["gpu"]):
        pytest.skip(problem)
    model = resolve_model("tiny-flux")
    config = QuantizeConfig(
        precision=precision, level=level, calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2
    )
    engine, _ = build(quantize.run(config, model, store), store, "tensorrt")
    assert engine.manifest["io"]["precision"] == "bf16"
    assert engine.manifest["details"]["quantization"]["quantize_layers"].get(precision.upper(), 0) > 0
    assert engine.manifest["details"]["optimization_level"]["level"] == 3  # review 4, S3: the demo keeps Flux at 3
    runtime = open_runtime(engine)
    dtypes = {t.name: t.dtype for t in runtime.spec.inputs()}
    assert runtime.dtype == torch.bfloat16 and dtypes["hidden_states"] == "bfloat16" and dtypes["timestep"] == "float32"
    runtime.close()
    report = validate(model, engine, ValidationConfig(steps=4))
    assert report, report.failures


# ---- issue 21: weight-stripped plans -------------------------------------------------------------------------------


def stripped_build(tiny_simplified, store, **config) -> Artifact:
    engine, _ = build(
        tiny_simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,), strip_weights=True, **config)
    )
    return engine


def test_a_stripped_plan_is_small_and_refilled_at_load(tiny_simplified, store, trt_engine):
    """STRIP_PLAN + REFIT_IDENTICAL: the plan leaves its weights in the graph, and runs as the full plan does once
    OnnxParserRefitter has put them back."""
    from sdtrt.stages.build_trt import parameter_count

    stripped = stripped_build(tiny_simplified, store)
    assert stripped.manifest["weights"]["in_plan"] is False and "--strip-weights" in stripped.manifest["reproduce"]
    assert stripped.manifest["weights"]["refill_from"]["artifact"] == str(tiny_simplified.path.resolve())
    weight_bytes = parameter_count(tiny_simplified.primary) * 2  # fp16
    full, small = trt_engine.primary.stat().st_size, stripped.primary.stat().st_size
    assert full - small > weight_bytes / 2, (full, small, weight_bytes)
    case = ValidationCase(2, 256, 256, 999.0, 0)
    expected = open_runtime(trt_engine).run(open_runtime(trt_engine).spec.case_inputs(case))["out_sample"].float()
    runtime = open_runtime(stripped)
    got = runtime.run(runtime.spec.case_inputs(case))["out_sample"].float()
    assert torch.allclose(got, expected, atol=2e-3, rtol=2e-3)
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.9999


def test_a_stripped_plan_without_refittable_takes_no_lora(tiny, tiny_simplified, store, tmp_path):
    """REFIT_IDENTICAL makes other values undefined behaviour: a LoRA is refused, saying how to rebuild."""
    from sdtrt.core.errors import LoraError
    from sdtrt.pipeline.loading import load_pipeline

    from .helpers import peft_lora

    pipe = load_pipeline(tiny, stripped_build(tiny_simplified, store))
    with pytest.raises(LoraError, match=r"--strip-weights but without --refittable.*--strip-weights --refittable"):
        pipe.unet.set_loras([(peft_lora(tiny, tmp_path / "a", seed=1, rank=4, alpha=8), 0.8)])


def test_a_stripped_refittable_plan_takes_loras_as_the_full_one_does(tiny, tiny_simplified, store, tmp_path):
    """--strip-weights --refittable (REFIT: all weights stripped): LoRAs refit it from base weights as before."""
    from sdtrt.pipeline.loading import load_pipeline

    from .helpers import peft_lora

    lora = peft_lora(tiny, tmp_path / "a", seed=1, rank=4, alpha=8)
    full, _ = build(tiny_simplified, store, "tensorrt", trt_config=TrtBuildConfig(profiles=(PROFILE,), refittable=True))
    outputs = []
    for engine in (full, stripped_build(tiny_simplified, store, refittable=True)):
        pipe = load_pipeline(tiny, engine)
        feeds = pipe.unet.runtime.spec.sample_inputs(2, 256, 256)
        base = pipe.unet.runtime.run(feeds)["out_sample"].float()
        pipe.unet.set_loras([(lora, 0.8)])
        with_lora = pipe.unet.runtime.run(feeds)["out_sample"].float()
        pipe.unet.clear_loras()
        assert torch.allclose(pipe.unet.runtime.run(feeds)["out_sample"].float(), base, atol=1e-3)
        outputs.append((base, with_lora))
    (full_base, full_lora), (stripped_base, stripped_lora) = outputs
    assert not torch.allclose(full_lora, full_base, atol=1e-3)
    assert torch.allclose(stripped_base, full_base, atol=2e-3) and torch.allclose(stripped_lora, full_lora, atol=2e-3)


def test_a_stripped_weight_streaming_plan_runs_within_a_budget(tiny_simplified, store, trt_engine):
    """The refill comes before the budget and the execution context, which split the refilled weights."""
    stripped = stripped_build(tiny_simplified, store, weight_streaming=True)
    case = ValidationCase(2, 256, 256)
    full = open_runtime(trt_engine)
    expected = full.run(full.spec.case_inputs(case))["out_sample"].float()
    for budget in ("0", "50%"):
        streamed = open_runtime(stripped, weight_budget=WeightBudget.parse(budget))
        got = streamed.run(streamed.spec.case_inputs(case))["out_sample"].float()
        assert torch.allclose(got, expected, atol=2e-3, rtol=2e-3)
        streamed.close()


def test_a_plan_recorded_as_stripped_that_is_not_refittable_is_refused_saying_so(tiny_simplified, trt_engine):
    """refill_weights asks ICudaEngine.refittable first: trt.Refitter over a plan that is not refittable would be a
    bare TypeError from pybind11 (a factory's nullptr), not a message saying to rebuild."""
    from sdtrt.graph.onnx_graph import artifact_spec
    from sdtrt.runtime.tensorrt import TensorRTRuntime
    from sdtrt.stages.build_trt import refill_record

    manifest = trt_engine.manifest | {"weights": refill_record(tiny_simplified)}  # the full, non-refittable plan
    with pytest.raises(ArtifactError, match="the plan is not refittable, so it cannot be stripped; rebuild"):
        TensorRTRuntime(trt_engine.primary, artifact_spec(trt_engine), manifest)


def test_the_tensorrt_members_of_a_set_share_one_activation_buffer(tiny, store):
    """Review 4, S2: the plans of a set run from one buffer of the largest member's device_memory_size_v2 (contexts
    USER_MANAGED), in turn, eager and from CUDA graphs, and compute what each computes alone with its own memory."""
    from sdtrt.runtime import open_members
    from sdtrt.stages.engine_set import engine_members

    config = TrtBuildConfig(profiles=(PROFILE,), refittable=True)  # the set holds the plans, not TorchScript wraps
    members = engine_members(compile_model(tiny, store, "tensorrt", trt_config=config).final)
    shared = open_members(members, tiny)
    alone = {c: open_runtime(a, tiny) for c, a in members.items()}
    pool = shared["unet"]._shared
    assert pool is not None and all(r._shared is pool for r in shared.values()) and alone["unet"]._shared is None
    assert pool.needed == max(int(r._engine.device_memory_size_v2) for r in shared.values())
    feeds = {c: r.spec.case_inputs(r.spec.validation_cases(PROFILE)[0]) for c, r in shared.items()}
    expected = {c: r.run(feeds[c]) for c, r in alone.items()}
    for graphs in (False, True):
        for _ in range(2):  # each member runs after the others have overwritten the buffer
            for component, runtime in shared.items():
                runtime.cuda_graph = graphs
                got = runtime.run(feeds[component])
                assert all(torch.equal(got[n], expected[component][n]) for n in got), (component, graphs)
    assert pool.generation == 1  # one buffer all along: the captured graphs replay against its address
    for runtime in [*shared.values(), *alone.values()]:
        runtime.close()
