"""Quantization of the transformer denoisers (issue 22): SD3's MMDiT and Flux's DiT (tiny-sd3, tiny-flux) quantized
with ModelOpt INT8/FP8, calibrated through their own pipelines, their Q/DQ graphs run on ONNX Runtime's CPU provider
and compared with ModelOpt's PyTorch fake quantization; the layers NVIDIA keeps in high precision carry no Q/DQ."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import onnx
import pytest
import torch

from sdtrt.core.config import QuantizeConfig, ValidationConfig
from sdtrt.core.errors import ConfigError
from sdtrt.runtime.compare import tensor_stats
from sdtrt.sources.models import resolve_model
from sdtrt.stages import calibration, qdq, quantize, quantize_layers
from tests.helpers import run_cli
from tests.test_quantize import onnxruntime_output, qdq_zero_point_types, quantized_modules

# Small: 2 prompts × 2 steps (SD3's guidance doubles the batch, Flux's embeds it).
CALIBRATION = {"calibration_prompts": ("a lighthouse at dusk", "a red fox in the snow"), "calibration_steps": 2}
INT8 = QuantizeConfig(precision="int8", level=2.5, **CALIBRATION)
FP8 = QuantizeConfig(precision="fp8", level=3, **CALIBRATION)
PRESETS = ("tiny-sd3", "tiny-flux")
# What NVIDIA keeps in high precision in these transformers (ModelOpt's filter_func_flux_dev / filter_func_default),
# as the tiny presets name the modules: embedders, timestep/guidance/text embeddings, the output norm and projection.
NVIDIA_KEPT = re.compile(r"^(pos_embed|time_text_embed|context_embedder|x_embedder|norm_out|proj_out)(\.|$)")


@pytest.fixture(
    scope="module", params=[(p, c) for p in PRESETS for c in (INT8, FP8)], ids=lambda p: f"{p[0]}-{p[1].precision}"
)
def quantized(request, store):
    """The fp32 and ModelOpt fake-quant outputs of the preset's transformer on a denoising step the calibration saw
    (its graph feeds), and the graphs the quantize stage stores for the same config: the seeded calibration gives
    the same quantizers, and test_compile_quantizes_only_the_transformer finds the stage's artifact cached."""
    from sdtrt.stages.graph_module import graph_module

    preset, config = request.param
    model = resolve_model(preset)
    spec = quantize.denoiser_graph_spec(model)
    pipe = calibration.load_reference_pipeline(model)
    fp32 = calibration.pipeline_denoiser(pipe, model)
    _, kwargs = calibration.record(pipe, fp32, config).calls[-1]
    feeds = {name: kwargs[name].float() for name in spec.input_names}
    result = quantize.quantized_denoiser(config, model)
    with torch.no_grad():
        outputs = {"fp32": graph_module(spec, fp32)(*feeds.values()),
                   "fake_quant": graph_module(spec, result.network)(*feeds.values())}  # fmt: skip
    artifact = quantize.run(config, model, store)
    paths = {role: artifact.path / name for role, name in artifact.manifest["graphs"].items()}
    return {"preset": preset, "config": config, "plan": result.plan, "feeds": feeds, "outputs": outputs,
            "graph": paths["onnxruntime"], "graphs": paths}  # fmt: skip


def test_graph_runs_on_onnxruntime_and_matches_modelopt_fake_quant(quantized):
    feeds, fp32, fake_quant = quantized["feeds"], quantized["outputs"]["fp32"], quantized["outputs"]["fake_quant"]
    quantization = tensor_stats(fake_quant, fp32)
    exact = tensor_stats(onnxruntime_output(quantized["graph"], feeds, optimized=False), fake_quant)
    kernels = tensor_stats(onnxruntime_output(quantized["graph"], feeds, optimized=True), fake_quant)
    print(
        f"\n{quantized['preset']} {quantized['config'].precision}: ModelOpt fake quant vs fp32 {quantization}\n"
        f"ORT (no graph optimizations) vs fake quant {exact}\nORT (its 8-bit kernels) vs fake quant {kernels}"
    )
    assert quantization["finite"] and quantization["cosine"] < 1.0  # something was quantized
    # Measured (2 prompts × 2 steps): ONNX Runtime's reference Q/DQ semantics give ModelOpt's fake quantization to the
    # noise floor (mean abs 2e-7 to 5e-7, a few roundings flipped by summation order: max abs up to 2e-3), where
    # quantization itself moves the output by 4e-4 (INT8) to 2e-3 (FP8) on average; ORT's INT8 kernels
    # (MatMulIntegerToFloat) requantize and land further off (cosine 0.99996).
    assert exact["finite"] and exact["mean_abs"] < 1e-5 and exact["cosine"] > 0.999999
    assert kernels["finite"] and kernels["cosine"] > 0.999


def test_qdq_nodes_are_the_plans_layers_and_never_nvidias_kept_ones(quantized):
    plan, config = quantized["plan"], quantized["config"]
    zero_point = {"int8": onnx.TensorProto.INT8, "fp8": onnx.TensorProto.FLOAT8E4M3FN}[config.precision]
    for path in set(quantized["graphs"].values()):
        graph = quantized_modules(path)
        # Each quantized Linear has an input and a weight quantizer; nothing else is quantized below level 4.
        assert graph == Counter({name: 2 for name in plan.quantized})
        assert qdq_zero_point_types(path) == {zero_point}
        assert not [name for name in graph if NVIDIA_KEPT.match(name)]
    standard = onnx.load(str(quantized["graph"]), load_external_data=False)
    assert not [n for n in standard.graph.node if n.domain == "trt"]
    assert quantized["graph"].name == "transformer.onnx"


# NVIDIA's 16-bit type for each family's quantized denoiser (sdtrt.stages.quantize.tensorrt_precision).
TENSORRT_TYPE = {"tiny-sd3": onnx.TensorProto.FLOAT16, "tiny-flux": onnx.TensorProto.BFLOAT16}
# The ops that carry a transformer's compute: all in the graph's 16-bit type. Flux's rotary embedding and its
# application stay fp32 (diffusers computes them in fp32, as NVIDIA's demo keeps them).
COMPUTE_OPS = ("MatMul", "Gemm", "Softmax", "LayerNormalization", "Conv", "DequantizeLinear")


def test_the_tensorrt_graph_is_16_bit_outside_qdq_and_computes_the_onnxruntime_graphs_network(quantized):
    """SD3's TensorRT graph is fp16 outside its Q/DQ pairs and Flux's bf16, as NVIDIA exports them: weights, scales
    and every matrix product, norm and softmax in that type, the Q/DQ nodes those of the fp32 ONNX Runtime graph. On
    ONNX Runtime it computes what the fp32 graph computes (Flux's bf16 graph, which ONNX Runtime's CPU provider does
    not run, widened to fp32 with its bf16-rounded weights and scales: the same network, rounded as TensorRT's)."""
    preset, graphs, feeds = quantized["preset"], quantized["graphs"], quantized["feeds"]
    wanted = TENSORRT_TYPE[preset]
    model = onnx.load(str(graphs["tensorrt"]))
    assert graphs["tensorrt"] != graphs["onnxruntime"]
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    assert {i.data_type for i in model.graph.initializer if i.data_type in floats} == {wanted}
    types = onnx.shape_inference.infer_shapes(model).graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*types.value_info, *types.output]}
    computed = Counter(
        onnx.TensorProto.DataType.Name(elem[n.output[0]]) for n in model.graph.node if n.op_type in COMPUTE_OPS
    )
    assert set(computed) == {onnx.TensorProto.DataType.Name(wanted)}, computed
    counts = {role: qdq.qdq_counts(path) for role, path in graphs.items()}
    assert counts["tensorrt"] == counts["onnxruntime"]
    assert quantized_modules(graphs["tensorrt"]) == quantized_modules(graphs["onnxruntime"])

    spec = quantize.graph_specs(resolve_model(preset), quantized["config"])["tensorrt"]
    dtypes = {t.name: getattr(torch, t.dtype) for t in spec.inputs()}
    narrow = {name: value.to(dtypes[name]) for name, value in feeds.items()}
    if wanted == onnx.TensorProto.BFLOAT16:
        model, narrow = widened(model), {name: value.float() for name, value in narrow.items()}
    fp32 = onnxruntime_output(graphs["onnxruntime"], feeds, optimized=False)
    output = onnxruntime_output(model, narrow, optimized=False)
    stats = tensor_stats(output.float(), fp32)
    print(f"\n{preset} {quantized['config'].precision}: TensorRT graph vs ONNX Runtime graph (fp32): {stats}")
    # Measured: cosine 0.9999997 / 0.9999987 (SD3 fp16, INT8 / FP8), 0.9999955 / 0.9999941 (Flux bf16); a wrong scale
    # or type gives noise.
    assert stats["finite"] and stats["cosine"] > 0.9999


def widened(model: onnx.ModelProto) -> onnx.ModelProto:
    """A bf16 graph computing in fp32: its bf16 initializers, constants, casts and IO retyped to fp32 (the values
    themselves are the bf16 ones, exactly representable)."""
    from onnx import numpy_helper

    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT

    def widen(tensor: onnx.TensorProto) -> None:
        if tensor.data_type == bf16:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype("float32"), tensor.name))

    for initializer in model.graph.initializer:
        widen(initializer)
    for node in model.graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                widen(attribute.t)
            elif node.op_type == "Cast" and attribute.name == "to" and attribute.i == bf16:
                attribute.i = fp32
    for value in [*model.graph.input, *model.graph.output]:
        if value.type.tensor_type.elem_type == bf16:
            value.type.tensor_type.elem_type = fp32
    del model.graph.value_info[:]
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_levels_select_nvidias_linear_layers(preset):
    """NVIDIA's quantize_lvl on a transformer: level 2 the feed-forward Linears, 2.5 adds to_q/to_k/to_v, 3 every
    Linear; never the layers it keeps (a Flux single block's proj_out is quantized, the final one is not)."""
    from sdtrt.sources.models import load_folder

    model = resolve_model(preset)
    network = load_folder(model, "transformer", torch.float32)
    kind = quantize_layers.denoiser_quantization(model)
    plans = {
        level: quantize_layers.plan_layers(network, dataclasses.replace(INT8, level=level), kind)
        for level in (2, 2.5, 3)
    }
    linear = {n for n, m in network.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = {n for n in linear if NVIDIA_KEPT.match(n)}
    assert kept and {"proj_out", "context_embedder"} <= kept
    assert set(plans[2].quantized) == {n for n in linear if ".ff.net." in n}
    assert set(plans[2.5].quantized) - set(plans[2].quantized) == {
        n for n in linear if n.endswith(("to_q", "to_k", "to_v"))
    }
    assert set(plans[3].quantized) == linear - kept
    for plan in plans.values():
        assert all(plan.kept[name].startswith("kept by NVIDIA") for name in kept)
    if preset == "tiny-flux":
        assert "single_transformer_blocks.0.proj_out" in plans[3].quantized


@pytest.mark.parametrize(
    ("preset", "config", "message"),
    [
        ("tiny-sd3", dataclasses.replace(INT8, level=1), "level 1 quantizes convolutions only, and a transformer's"),
        ("tiny-flux", dataclasses.replace(FP8, level=1), "use --level 2, 2.5, 3"),
        ("tiny-sd3", dataclasses.replace(FP8, level=4), "FP8 attention for UNets only so far; use --level 2, 2.5, 3"),
        ("tiny-flux", dataclasses.replace(FP8, level=4), "FP8 attention for UNets only so far; use --level 2, 2.5, 3"),
    ],
)
def test_levels_that_make_no_sense_for_a_transformer_are_refused(preset, config, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        quantize.check_model(config, resolve_model(preset))
    assert "\n" not in str(caught.value)


def test_level_1_on_a_transformer_is_refused_in_one_line_at_the_cli(tmp_path):
    result = run_cli("quantize", "--model", "tiny-flux", "--level", "1", "--engines", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "use --level 2, 2.5, 3" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_calibration_records_the_transformers_own_inputs():
    """Flux's calls carry its packed latents, positions and guidance, its timestep the schedule's t / 1000."""
    model = resolve_model("tiny-flux")
    pipe = calibration.load_reference_pipeline(model)
    calls = calibration.record(pipe, calibration.pipeline_denoiser(pipe, model), INT8).calls
    assert len(calls) == len(INT8.calibration_prompts) * INT8.calibration_steps
    spec = quantize.denoiser_graph_spec(model)
    for args, kwargs in calls:
        assert not args and set(spec.input_names) <= set(kwargs)
        assert kwargs["hidden_states"].shape[-1] == spec.in_channels and kwargs["guidance"].shape == (1,)
        assert 0.0 <= float(kwargs["timestep"][0]) <= 1.0


@pytest.mark.parametrize("config", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("preset", PRESETS)
def test_compile_quantizes_only_the_transformer(preset, config, store):
    """``compile --precision int8|fp8`` of a transformer model: the denoiser's chain starts at the quantize stage, and
    the image against the fp32 pipeline's is reported (random tiny weights: a sanity bound only)."""
    from sdtrt.tools.compile import compile_model

    result = compile_model(
        resolve_model(preset), store, "onnxruntime", components=("transformer",), quantize_config=config,
        validation=ValidationConfig(steps=4),
    )  # fmt: skip
    assert [a.stage for a in result.artifacts] == ["quantize", "simplify", "build-ort"]
    assert result.artifacts[0].manifest["details"]["qdq"]["onnxruntime"]
    report = result.validation
    assert report is not None and report.image is not None
    psnr = report.image["psnr_db"]
    print(
        f"\n{preset} {config.precision.upper()} level {config.level:g}: image PSNR against fp32 {psnr:.1f} dB; "
        f"tensors {report.tensors[0]}"
    )
    assert math.isfinite(psnr) and psnr > 10
    assert report.precision == f"{config.precision} level {config.level:g} (ONNX Runtime graph, fp32 outside Q/DQ)"


def test_the_guard_ranks_a_transformers_quantized_layers():
    """The accuracy guard's ranking records the calibration calls on the pipeline's transformer (Flux: no unet)."""
    from sdtrt.tools.guard import rank_layers

    model = resolve_model("tiny-flux")
    config = dataclasses.replace(INT8, calibration_prompts=INT8.calibration_prompts[:1])
    errors = rank_layers(config, model)
    plan = quantize_layers.plan_layers(
        calibration.pipeline_denoiser(calibration.load_reference_pipeline(model), model),
        config,
        quantize_layers.denoiser_quantization(model),
    )
    assert set(errors) == set(plan.quantized)
    assert all(math.isfinite(error) and error > 0 for error in errors.values())
