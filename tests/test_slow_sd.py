"""Scale checks on the full SD 1.5, SD 2.1 (768, v-prediction) and SDXL base architectures, random weights.

Opt-in: pytest -m slow. SD 2.1 sets upcast_attention: its fp16 graph must keep softmax in fp32. Issue 11
asks that fp16 export + simplify of SDXL's 2.6 B-parameter UNet fit a 2-core / 24 GB machine (≤ 20 GB peak).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import ExportConfig, SimplifyConfig
from sdtrt.core.store import Store
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import ModelSource, load_unet, resolve_model
from sdtrt.spec import ValidationCase
from sdtrt.stages import export, simplify
from sdtrt.tools.validate import compare_case

from .helpers import softmax_input_types

pytestmark = pytest.mark.slow


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def fp16_export_and_simplify(preset: str, tmp_path: Path) -> tuple[ModelSource, Artifact, Artifact, dict[str, float]]:
    """The preset's UNet exported in fp16 and simplified, with each step's seconds."""
    timings = {}
    started = time.perf_counter()
    model = resolve_model(preset)
    timings["preset"] = time.perf_counter() - started
    store = Store(tmp_path)
    started = time.perf_counter()
    exported = export.run(ExportConfig(precision="fp16"), model, store)
    timings["export"] = time.perf_counter() - started
    started = time.perf_counter()
    simplified = simplify.run(SimplifyConfig(), exported, store)
    timings["simplify"] = time.perf_counter() - started
    return model, exported, simplified, timings


@pytest.mark.parametrize(("preset", "size", "batch"), [("sd15-random", 512, 2), ("sd21-random", 768, 1)])
def test_fp16_export_simplify_and_parity(tmp_path, preset, size, batch):
    model, _, simplified, timings = fp16_export_and_simplify(preset, tmp_path)
    details = simplified.manifest["details"]
    assert details["nodes_after"] < details["nodes_before"]

    started = time.perf_counter()
    runtime = open_runtime(simplified)
    stats = compare_case(runtime, load_unet(model), runtime.spec, ValidationCase(batch, size, size))
    timings["parity"] = time.perf_counter() - started
    print(
        f"\n{preset} fp16, batch {batch} at {size}²: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}; "
        f"nodes {details['nodes_before']} -> {details['nodes_after']} ({details['method']}); "
        f"max abs {stats['max_abs']:.3g}, cosine {stats['cosine']:.6f}; peak RSS {peak_rss_gb():.1f} GB"
    )
    assert stats["finite"] and stats["cosine"] >= 0.999
    upcast = model.unet_config().get("upcast_attention", False)
    assert softmax_input_types(simplified.primary) == {TensorProto.FLOAT if upcast else TensorProto.FLOAT16}


def test_sd15_loras_on_unet_and_text_encoder_engines_match_diffusers(tmp_path):
    """Issue 12's scale check on sd15-random, ONNX Runtime: two LoRAs at different scales, one of them on
    the UNet and the text encoder, against diffusers' fused pipeline; times each set_loras."""
    from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline, set_loras
    from sdtrt.tools.compile import compile_model
    from sdtrt.tools.image_quality import psnr_db

    from .helpers import peft_lora

    model = resolve_model("sd15-random")
    both = peft_lora(model, tmp_path / "both", seed=1, rank=8, alpha=8, networks=("unet", "text_encoder"))
    unet_only = peft_lora(model, tmp_path / "unet", seed=2, rank=4, alpha=8)
    loras = [(both, 0.8), (unet_only, 0.5)]
    started = time.perf_counter()
    engines = compile_model(model, Store(tmp_path / "engines"), "onnxruntime", components=("unet", "text_encoder"))
    compile_s = time.perf_counter() - started
    pipe = load_pipeline(model, engines.final)
    swaps = {}
    for label, case in (("first (maps made)", loras[:1]), ("clear", []), ("two", loras)):
        started = time.perf_counter()
        set_loras(pipe, case)
        swaps[label] = time.perf_counter() - started
    request = GenerateRequest("a lighthouse at dusk", steps=2, seed=3, height=512, width=512)
    got = np.asarray(generate(pipe, request).images[0], dtype=np.float64) / 255
    reference = np.asarray(generate(load_pipeline(model, loras=loras), request).images[0], dtype=np.float64)
    psnr = psnr_db(got, reference / 255)
    print(
        f"\nsd15-random LoRAs (UNet + text encoder, ONNX Runtime): compile {compile_s:.0f} s; set_loras "
        f"{', '.join(f'{k} {v:.1f} s' for k, v in swaps.items())}; PSNR {psnr:.1f} dB; peak RSS {peak_rss_gb():.1f} GB"
    )
    assert psnr >= 35


def test_sdxl_fp16_unet_export_and_simplify_fit_in_20_gb(tmp_path):
    _, exported, simplified, timings = fp16_export_and_simplify("sdxl-random", tmp_path)
    details = simplified.manifest["details"]
    print(
        f"\nsdxl-random fp16 UNet: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}; "
        f"nodes {details['nodes_before']} -> {details['nodes_after']} ({details['method']}); "
        f"peak RSS {peak_rss_gb():.1f} GB"
    )
    assert exported.manifest["family"] == "sdxl" and exported.manifest["details"]["external_data"]
    assert peak_rss_gb() <= 20.0
