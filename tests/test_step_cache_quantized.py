"""Step caches on a quantized transformer set (issue 36): ``compile --precision int8 --caches first-block`` cuts the
split members from the denoiser's calibrated network, so their Q/DQ scales are the whole's, and diffusers' First-Block
Cache runs on the 8-bit engines as on fp32 ones."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig
from onnx import numpy_helper

import sdtrt
from sdtrt.core.config import ExportConfig, QuantizeConfig, ValidationConfig
from sdtrt.core.errors import ArtifactError
from sdtrt.core.store import Store
from sdtrt.sources.models import resolve_model
from sdtrt.stages import quantize
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import last_line, run_cli
from tests.test_step_cache import PARTS, generate

INT8 = QuantizeConfig(precision="int8", level=2.5, calibration_prompts=("a lighthouse at dusk",), calibration_steps=2)


@pytest.fixture(scope="module")
def quantized_set(store):
    model = resolve_model("tiny-flux")
    fp32 = ExportConfig(precision="fp32")
    return compile_model(
        model, store, "onnxruntime", fp32, quantize_config=INT8, caches=("first-block",), validation=ValidationConfig()
    )


def qdq_scales(path) -> list[float]:
    """Every QuantizeLinear's scale in a graph, sorted."""
    graph = onnx.load(path).graph
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    constants |= {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"}
    return sorted(
        float(v) for n in graph.node if n.op_type == "QuantizeLinear" for v in constants[n.input[1]].reshape(-1)
    )


def test_the_split_members_carry_the_whole_transformers_scales(quantized_set, store):
    members = {a.component(): a for a in quantized_set.artifacts if a.stage == "quantize"}
    assert set(members) == {"transformer", *PARTS}
    # One calibration: the whole's artifact is the one a compile without caches gets (its key is unchanged).
    assert members["transformer"].path == quantize.run(INT8, resolve_model("tiny-flux"), store).path
    assert all(members[p].manifest["details"]["split_member_of"] == "transformer" for p in PARTS)
    whole = qdq_scales(members["transformer"].primary)
    assert whole and sorted(s for p in PARTS for s in qdq_scales(members[p].primary)) == whole
    assert qdq_scales(members["transformer_rest"].primary)  # the blocks are quantized, the embedders kept
    assert not qdq_scales(members["transformer_embed"].primary)
    for part in PARTS:  # TensorRT's graphs are bf16 outside the Q/DQ pairs (Flux), ONNX Runtime's fp32
        graphs = members[part].manifest["graphs"]
        types = {role: input_types(members[part].path / name) for role, name in graphs.items()}
        assert types == {"tensorrt": {"bfloat16"}, "onnxruntime": {"float32"}}, (part, types)


def input_types(path) -> set[str]:
    """The element types of a graph's token inputs (positions and the rotary embedding are fp32 in any graph)."""
    inputs = onnx.load(path, load_external_data=False).graph.input
    return {
        onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
        for i in inputs
        if "hidden_states" in i.name or i.name == "temb"
    }


def test_members_made_after_the_denoiser_share_its_calibration_or_are_refused(tmp_path):
    """FP8, the denoiser quantized first (a compile without --caches), its members later: one calibration result;
    a stored denoiser without that record is refused, and no member is stored."""
    model, fp8 = resolve_model("tiny-flux"), dataclasses.replace(INT8, precision="fp8", level=3.0)
    store = Store(tmp_path / "engines")
    whole = quantize.run(fp8, model, store)
    members = quantize.run_members(fp8, model, store, PARTS)
    assert members["transformer"].path == whole.path
    results = {a.manifest["details"]["calibration_result"] for a in members.values()}
    assert len(results) == 1 and results == {whole.manifest["details"]["calibration_result"]}
    assert sorted(s for p in PARTS for s in qdq_scales(members[p].primary)) == qdq_scales(whole.primary)
    older = Store(tmp_path / "older")
    made = quantize.run(fp8, model, older)
    manifest = json.loads((made.path / "manifest.json").read_text())
    del manifest["details"]["calibration_result"]  # as a denoiser quantized before sdtrt recorded it
    (made.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"predates sdtrt's record of its calibration, .*; delete that folder"):
        quantize.run_members(fp8, model, older, PARTS)
    assert [a.component() for a in older.artifacts()] == ["transformer"]


def test_the_set_validates_every_member_to_8_bit_tolerances(quantized_set):
    report = quantized_set.validation
    assert report is not None and report, report and report.failures
    assert {"transformer", *PARTS} <= set(report.members)


def test_first_block_cache_runs_on_the_quantized_engines(quantized_set, decisions):
    pipe = sdtrt.load_pipeline(resolve_model("tiny-flux"), quantized_set.final)
    plain = generate(pipe)
    chained = generate(pipe, FirstBlockCacheConfig(threshold=0.0))  # the split members on every step
    assert set(decisions) == {"C"}
    decisions.clear()
    assert np.array_equal(chained, plain)  # the members chained compute the quantized whole, bit for bit
    cached = generate(pipe, FirstBlockCacheConfig(threshold=0.6))
    assert "s" in decisions and psnr_db(cached, plain) < 80  # it skipped, and that changed the image
    assert (generate(pipe) == plain).all()  # disable_cache: the whole engine again, bit for bit


@pytest.mark.slow  # 46 s: DeepCache, FreeU and int8 each keep their own default tests; this is their combination
def test_deepcache_and_freeu_run_on_a_quantized_unet(store):
    model = resolve_model("tiny")
    result = compile_model(model, store, "onnxruntime", ExportConfig(precision="fp32"), quantize_config=INT8,
                           caches=("deepcache",), freeu=True)  # fmt: skip
    members = {a.component(): a for a in result.artifacts if a.stage == "quantize"}
    # The deep member and the FreeU build are the whole UNet (with one more output, one more input): the same
    # quantizers, every one.
    for whole in ("unet_deep", "unet_freeu"):
        assert qdq_scales(members[whole].primary) == qdq_scales(members["unet"].primary)
    assert set(qdq_scales(members["unet_shallow"].primary)) < set(qdq_scales(members["unet"].primary))
    pipe, reference = sdtrt.load_pipeline(model, result.final), sdtrt.load_pipeline(model)
    call = {"num_inference_steps": 10, "height": 128, "width": 128, "output_type": "np"}

    def run(target):
        return target("a cat", generator=torch.Generator().manual_seed(0), **call).images

    plain = run(pipe)
    helper = sdtrt.DeepCache(pipe)
    helper.set_params(cache_interval=3, cache_branch_id=0)
    helper.enable()
    cached = run(pipe)
    helper.disable()
    print(f"\nINT8 tiny, DeepCache interval 3 against every step in full: {psnr_db(cached, plain):.1f} dB")
    assert 20 < psnr_db(cached, plain) < 80  # close, and changed: the shallow member ran
    assert np.array_equal(run(pipe), plain)
    for target in (pipe, reference):
        target.enable_freeu(s1=0.9, s2=0.2, b1=1.3, b2=1.4)
    freeu, on_pytorch = run(pipe), run(reference)
    # Measured: 46.1 dB against PyTorch's fp32 FreeU image, as the plain INT8 image is from PyTorch's (46.6 dB).
    print(f"INT8 tiny, FreeU against PyTorch fp32 FreeU: {psnr_db(freeu, on_pytorch):.1f} dB")
    assert psnr_db(freeu, on_pytorch) > 40 and psnr_db(freeu, plain) < 45
    factors = ("--freeu", "0.9,0.2,1.3,1.4")
    both = run_cli("generate", "--engine", str(result.final.path), *factors, "--cache", "deepcache:3")
    assert both.returncode == 2 and "DeepCache's members have no FreeU" in last_line(both.stderr)
