"""Step caches on transformer engines (issue 36): diffusers' own FirstBlockCache, MagCache and TaylorSeer (lite) on an
engine set compiled with ``caches=("first-block",)``, checked against the same configs on the PyTorch pipeline.

The engine decides which steps to skip with diffusers' own hooks on the engines' tensors; these tests record every
decision diffusers' First-Block Cache makes (a spy over its rule, which it still runs) on both pipelines and compare
the strings step for step, and the images. SD3: diffusers' First-Block Cache fails on PyTorch SD3 (its last block
returns no text tokens, and StableDiffusion3Pipeline opens no cache context), so its reference is diffusers' hooks on
the PyTorch blocks with the last block passing the text tokens through, inside a cache context: the same algorithm.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers.hooks import (
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
    apply_first_block_cache,
)
from diffusers.hooks import first_block_cache as fbc
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from diffusers.models.cache_utils import CacheMixin

import sdtrt
from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import ConfigError, EngineInputError
from sdtrt.core.trt_products import rtx_missing
from sdtrt.lora.files import random_lora
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import component_spec
from sdtrt.spec.transformer_split import TransformerPartSpec, part_class
from sdtrt.stages.graph_module import graph_module
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db, ssim

from .helpers import run_cli

STEPS = 10
CALL = {"num_inference_steps": STEPS, "height": 128, "width": 128, "output_type": "np"}
PARTS = ("transformer_embed", "transformer_first_block", "transformer_rest", "transformer_out")


@pytest.fixture(scope="module")
def cached_sets(store):
    """preset → its fp32 ONNX Runtime engine set with the split members (the other members: the pipeline tests')."""
    built = {}

    def get(preset: str):
        if preset not in built:
            fp32 = ExportConfig(precision="fp32")
            built[preset] = compile_model(resolve_model(preset), store, "onnxruntime", fp32, caches=("first-block",))
        return built[preset].final

    return get


@pytest.fixture
def decisions(monkeypatch):
    """Every First-Block Cache decision diffusers makes, in order: "C" computes the other blocks, "s" skips them."""
    made: list[str] = []
    rule = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, residual):
        compute = rule(self, residual)
        made.append("C" if compute else "s")
        return compute

    monkeypatch.setattr(fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks", spy)
    return made


def generate(pipe, config=None, context=contextlib.nullcontext, **call) -> np.ndarray:
    if config is not None:
        pipe.transformer.enable_cache(config)
    try:
        with context():
            return pipe("a cat", generator=torch.Generator().manual_seed(0), **CALL, **call).images
    finally:
        if config is not None:
            pipe.transformer.disable_cache()


@pytest.mark.parametrize("preset", ["tiny-flux", "tiny-flux-schnell", "tiny-sd3"])
def test_the_parts_chained_compute_the_whole_transformer(preset):
    model = resolve_model(preset)
    network = load_folder(model, "transformer", torch.float32)
    whole = component_spec(model, "transformer", "fp32")
    parts = {c: component_spec(model, c, "fp32") for c in PARTS}
    assert all(isinstance(s, TransformerPartSpec) for s in parts.values())
    feeds = whole.sample_inputs(2, 128, 128, seed=0, tokens=16)
    with torch.no_grad():
        expected = graph_module(whole, network)(*feeds.values())
        tensors = dict(feeds)
        for component in PARTS:
            spec = parts[component]
            if component == "transformer_out":
                tensors |= {"hidden_states": tensors["rest_hidden_states"], "latents": feeds["hidden_states"]}
            outputs = graph_module(spec, network)(*(tensors[name] for name in spec.canonical_inputs))
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            tensors |= dict(zip(spec.canonical_outputs, outputs, strict=True))
            if component == "transformer_embed":  # the blocks take the embedded tokens under their own names
                tensors |= {k.removeprefix("embedded_"): v for k, v in tensors.items() if k.startswith("embedded_")}
            if component == "transformer_first_block":
                tensors |= {"hidden_states": tensors["block_hidden_states"],
                            "encoder_hidden_states": tensors["block_encoder_hidden_states"]}  # fmt: skip
    assert torch.equal(tensors["out_sample"], expected)


def test_first_block_cache_on_flux_engines_skips_the_steps_diffusers_skips(cached_sets, decisions):
    reference = sdtrt.load_pipeline("tiny-flux")
    engines = sdtrt.load_pipeline("tiny-flux", engine=cached_sets("tiny-flux"))
    uncached = generate(engines)
    for threshold in (0.3, 0.6):
        decisions.clear()
        expected = generate(reference, FirstBlockCacheConfig(threshold=threshold))
        on_pytorch = "".join(decisions)
        decisions.clear()
        image = generate(engines, FirstBlockCacheConfig(threshold=threshold))
        assert "".join(decisions) == on_pytorch, threshold
        assert "s" in on_pytorch, on_pytorch  # a cache that skips, or no test
        assert psnr_db(image, expected) >= 35.0
        assert psnr_db(image, uncached) < 80.0  # the skipped steps changed the image: the cache ran
    assert np.array_equal(generate(engines), uncached)  # disable_cache: the whole engine again, bit for bit
    # True CFG: two passes a step, each in its own cache context ("cond", "uncond") with its own state.
    true_cfg = {"negative_prompt": "a dog", "true_cfg_scale": 2.0}
    decisions.clear()
    expected = generate(reference, FirstBlockCacheConfig(threshold=0.3), **true_cfg)
    on_pytorch = "".join(decisions)
    decisions.clear()
    image = generate(engines, FirstBlockCacheConfig(threshold=0.3), **true_cfg)
    assert "".join(decisions) == on_pytorch and len(on_pytorch) == 2 * STEPS and "s" in on_pytorch
    assert psnr_db(image, expected) >= 35.0


class PassTextThrough(torch.nn.Module):
    """SD3's last block (context_pre_only) returns no text tokens; diffusers' First-Block Cache subtracts them and
    TaylorSeer reads their dtype. The reference keeps the block and hands back the tokens it was given, which nothing
    reads after the last block."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
        text, hidden = self.block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb)
        return encoder_hidden_states if text is None else text, hidden


def test_sd3_engines_match_diffusers_hooks_on_the_pytorch_blocks(cached_sets, decisions):
    """First-Block Cache at two thresholds and TaylorSeer lite, each against diffusers' own hooks applied to a fresh
    PyTorch SD3 transformer (apply_*: SD3's class has no enable_cache) inside a cache context."""
    from diffusers.hooks import apply_taylorseer_cache

    TransformerBlockRegistry.register(
        model_class=PassTextThrough,
        metadata=TransformerBlockMetadata(return_hidden_states_index=1, return_encoder_hidden_states_index=0),
    )
    engines = sdtrt.load_pipeline("tiny-sd3", engine=cached_sets("tiny-sd3"))
    uncached = generate(engines)
    taylorseer = TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=2, use_lite_mode=True, taylor_factors_dtype=torch.float32
    )
    for config in (FirstBlockCacheConfig(threshold=0.4), FirstBlockCacheConfig(threshold=0.6), taylorseer):
        reference = sdtrt.load_pipeline("tiny-sd3")
        blocks = reference.transformer.transformer_blocks
        blocks[-1] = PassTextThrough(blocks[-1])  # TaylorSeer's hooks fail on its None too
        apply = apply_first_block_cache if isinstance(config, FirstBlockCacheConfig) else apply_taylorseer_cache
        apply(reference.transformer, config)
        decisions.clear()
        expected = generate(reference, context=lambda r=reference: CacheMixin.cache_context(r.transformer, "cond"))
        on_pytorch = "".join(decisions)
        decisions.clear()
        image = generate(engines, config)
        assert "".join(decisions) == on_pytorch, config
        assert "s" in on_pytorch or not isinstance(config, FirstBlockCacheConfig), on_pytorch  # a cache that skips
        assert psnr_db(image, expected) >= 35.0, config
        assert psnr_db(image, uncached) < 80.0, config  # steps were skipped


@pytest.mark.parametrize(
    "config",
    [
        TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=2, use_lite_mode=True, taylor_factors_dtype=torch.float32
        ),
        MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, mag_ratios=FLUX_MAG_RATIOS),
    ],
    ids=["taylorseer-lite", "magcache"],
)
def test_taylorseer_lite_and_magcache_on_flux_engines_match_pytorch(cached_sets, config):
    reference = sdtrt.load_pipeline("tiny-flux")
    engines = sdtrt.load_pipeline("tiny-flux", engine=cached_sets("tiny-flux"))
    uncached = generate(engines)
    rest = engines.transformer.opened_split().rest
    before = rest.calls
    image = generate(engines, config)
    assert rest.calls - before < STEPS  # some steps ran no block after the first
    assert psnr_db(image, generate(reference, config)) >= 35.0
    assert psnr_db(image, uncached) < 80.0


def test_caches_an_engine_cannot_honour_are_refused_in_one_line(cached_sets, fp32_engine_sets):
    engines = sdtrt.load_pipeline("tiny-flux", engine=cached_sets("tiny-flux"))
    with pytest.raises(EngineInputError, match="use_lite_mode=True"):
        engines.transformer.enable_cache(TaylorSeerCacheConfig())  # predicts attention inside the blocks
    assert not engines.transformer.is_cache_enabled
    with pytest.raises(EngineInputError, match="attention layers inside the blocks"):
        engines.transformer.enable_cache(PyramidAttentionBroadcastConfig())
    plain = sdtrt.load_pipeline("tiny-flux", engine=fp32_engine_sets("tiny-flux"))
    with pytest.raises(EngineInputError, match="--caches first-block"):
        plain.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))


def test_compile_refuses_a_cache_the_model_cannot_take(tiny, store):
    with pytest.raises(ConfigError, match="UNet"):
        compile_model(tiny, store, "onnxruntime", caches=("first-block",))
    with pytest.raises(ConfigError, match="unknown step cache 'teacache'"):
        compile_model(resolve_model("tiny-flux"), store, "onnxruntime", caches=("teacache",))


def test_loras_change_the_split_members_as_they_change_the_whole_engine(cached_sets, tmp_path):
    model = resolve_model("tiny-flux")
    lora = random_lora(model, tmp_path / "a.safetensors", rank=4, alpha=8, seed=1)
    engines = sdtrt.load_pipeline(model, engine=cached_sets("tiny-flux"))
    base = generate(engines)
    every_step = FirstBlockCacheConfig(threshold=1e-9)  # the chain on every step: the whole engine's image
    sdtrt.set_loras(engines, [(lora, 1.0)])
    with_lora = generate(engines)
    assert psnr_db(with_lora, base) < 60  # the LoRA changes the image
    assert psnr_db(generate(engines, every_step), with_lora) > 100
    sdtrt.set_loras(engines, [])
    assert psnr_db(generate(engines, every_step), base) > 100  # and leaves the parts at base again


def test_a_part_spec_survives_its_manifest(cached_sets):
    from sdtrt.graph.onnx_graph import artifact_spec
    from sdtrt.stages.engine_set import engine_members

    members = engine_members(cached_sets("tiny-flux"))
    reproduce = cached_sets("tiny-flux").manifest["reproduce"]
    assert reproduce.endswith(" --caches first-block") and "transformer_embed" not in reproduce  # runs as it says
    for component in PARTS:
        spec = artifact_spec(members[component])
        assert type(spec) is part_class(component, "FluxTransformer2DModel")
        assert spec == component_spec(resolve_model("tiny-flux"), component, "fp32")


def test_the_cli_builds_the_split_and_runs_a_cache_in_generate_and_bench(cached_sets, tmp_path):
    built = run_cli("compile", "--model", "tiny-flux", "--target", "onnxruntime", "--precision", "fp32",
                    "--caches", "first-block", "--no-validate", check=True)  # fmt: skip
    assert built.stdout.strip().splitlines()[-1] == str(cached_sets("tiny-flux").path)
    image = tmp_path / "cat.png"
    size = ("--height", "128", "--width", "128")
    run_cli("generate", "--engine", str(cached_sets("tiny-flux").path), "--cache", "first-block:0.3", "--steps", "10",
            *size, "--out", str(image), check=True)  # fmt: skip
    assert image.stat().st_size > 0
    report = tmp_path / "bench.json"
    run_cli("bench", "--model", "tiny-flux", "--backends", "onnxruntime:fp32", "--steps", "10", "--repeats", "1",
            "--warmup", "0", *size, "--cache", "first-block:0.3", "--json", str(report), check=True)  # fmt: skip
    cached = json.loads(report.read_text())["backends"][0]["step_cache"]
    assert cached["denoiser_calls"] == 10 and 0 < cached["full_evaluations"] < 10
    assert cached["skipped_share"] == pytest.approx(1 - cached["full_evaluations"] / 10)
    assert cached["psnr_db"] > 35 and 0.9 < cached["ssim"] <= 1.0


def test_a_cache_option_parses_to_its_kind_and_setting():
    from sdtrt.pipeline.step_cache import StepCache

    assert StepCache.parse("taylorseer") == StepCache("taylorseer", 5.0)  # each kind's default without a value
    assert StepCache.parse("deepcache") == StepCache("deepcache", 3.0)
    assert StepCache.parse("first-block:0.08") == StepCache("first-block", 0.08)
    refused = {"deepcache:0": "1 or more", "taylorseer:2.5": "whole number", "first-block:": "not a number",
               "magcache:-1": "over 0", "teacache": "unknown step cache"}  # fmt: skip
    for text, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            StepCache.parse(text)


def test_the_cli_refuses_a_cache_in_one_line_before_loading_anything(fp32_engine_sets, tmp_path):
    unet = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", "--caches", "first-block")
    assert unet.returncode == 2 and "its denoiser is a UNet; use --caches deepcache" in unet.stderr
    for value in ("high", "nan"):
        malformed = run_cli("generate", "--model", "tiny-flux", "--cache", f"first-block:{value}")
        assert malformed.returncode == 2 and f"'{value}' is not a number" in malformed.stderr
    report = tmp_path / "report.json"
    plain = str(fp32_engine_sets("tiny-flux").path)
    for command, extra in (("generate", ("--out", str(tmp_path / "x.png"))), ("validate", ("--json", str(report)))):
        refused = run_cli(command, "--engine", plain, "--cache", "first-block:0.3", *extra)
        assert refused.returncode == 2 and "recompile it with `sdtrt compile --caches first-block`" in refused.stderr
        assert refused.stderr.count("\n") == 1 and not report.exists()  # one line, before anything ran
    sd3 = run_cli("generate", "--model", "tiny-sd3", "--cache", "magcache")
    assert sd3.returncode == 2 and "diffusers publishes for Flux only" in sd3.stderr


def test_ssim_is_one_for_equal_images_and_the_paper_s_luminance_term_for_flat_ones():
    rng = np.random.default_rng(0)
    image = rng.random((1, 32, 32, 3))
    assert ssim(image, image) == pytest.approx(1.0)
    noisy = np.clip(image + rng.normal(0, 0.1, image.shape), 0, 1)
    assert 0.0 < ssim(noisy, image) < 0.95 and ssim(noisy, image) == pytest.approx(ssim(image, noisy))
    c1 = 0.01**2  # flat images: no contrast or structure, SSIM is the luminance term alone
    expected = (2 * 0.5 * 0.7 + c1) / (0.5**2 + 0.7**2 + c1)
    assert ssim(np.full((16, 16, 1), 0.5), np.full((16, 16, 1), 0.7)) == pytest.approx(expected)


@pytest.mark.skipif(bool(rtx_missing()), reason=f"builds TensorRT-RTX plans: {rtx_missing()}")
def test_the_split_members_build_as_tensorrt_rtx_plans(store):
    """The TensorRT build path the two products share, run for real on the four fp16 parts of Flux."""
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.stages import export, simplify
    from sdtrt.tools.compile import build

    model = resolve_model("tiny-flux")
    for component in PARTS:
        graph = simplify.run(SimplifyConfig(), export.run(ExportConfig(component=component), model, store), store)
        plan, _ = build(graph, store, "tensorrt-rtx")
        details = plan.manifest["details"]
        assert details["layer_types"].get("HALF"), details["layers"]  # built in the graph's fp16, as asked
        assert (plan.path / plan.manifest["primary"]).stat().st_size > 0


def test_calibrate_cache_stores_the_boldest_setting_within_the_target_and_auto_uses_it(cached_sets, tmp_path):
    engine = str(cached_sets("tiny-flux").path)
    short = ("--steps", "4", "--prompts", "1", "--height", "128", "--width", "128")
    found = run_cli("calibrate-cache", "--engine", engine, "--min-psnr", "60", *short, check=True)
    calibration = json.loads((Path(found.stdout.strip().splitlines()[-1]) / "calibration.json").read_text())
    kept = [row for row in calibration["tried"] if row["min_psnr_db"] is None or row["min_psnr_db"] >= 60]
    assert calibration["chosen"] == kept[-1] and len(kept) == len(calibration["tried"]) - (kept != calibration["tried"])
    image = tmp_path / "auto.png"
    used = run_cli("generate", "--engine", engine, "--cache", "auto", "--steps", "4", "--height", "128", "--width",
                   "128", "--out", str(image), check=True)  # fmt: skip
    assert f"--cache auto: {calibration['chosen']['cache']}" in used.stderr
    other = run_cli("generate", "--engine", engine, "--cache", "auto", "--steps", "5", "--out", str(image))
    assert other.returncode == 2 and "no calibration" in other.stderr and "--steps 5" in other.stderr
    # The newest calibration is the one auto reads (a run asked again, a cache hit, becomes the newest); auto:KIND
    # reads the newest of that kind.
    newer = run_cli("calibrate-cache", "--engine", engine, "--cache", "taylorseer", "--min-psnr", "20", *short)
    taylorseer = json.loads((Path(newer.stdout.strip().splitlines()[-1]) / "calibration.json").read_text())["chosen"]
    for cache, chosen in (("auto", taylorseer), ("auto:first-block", calibration["chosen"])):
        used = run_cli("generate", "--engine", engine, "--cache", cache, "--steps", "4", "--height", "128", "--width",
                       "128", "--out", str(image), check=True)  # fmt: skip
        assert f"{chosen['cache']}, as calibrate-cache found it" in used.stderr
    run_cli("calibrate-cache", "--engine", engine, "--min-psnr", "60", *short, check=True)  # a cache hit
    again = run_cli("generate", "--engine", engine, "--cache", "auto", "--steps", "4", "--height", "128", "--width",
                    "128", "--out", str(image), check=True)  # fmt: skip
    assert f"{calibration['chosen']['cache']}, as calibrate-cache found it" in again.stderr
    # TaylorSeer predicts some steps at its most cautious interval already: no image stays unchanged.
    unreachable = run_cli("calibrate-cache", "--engine", engine, "--cache", "taylorseer", "--min-psnr", "1000", *short)
    assert unreachable.returncode == 2 and "no setting of taylorseer kept 1000 dB" in unreachable.stderr


def test_a_triton_deployment_runs_every_request_with_its_step_cache(cached_sets, fp32_engine_sets, tmp_path):
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.serving.deploy import Deployment, TritonDeployConfig, deploy_triton
    from sdtrt.serving.triton_model import TritonPythonModel

    refused = run_cli("deploy", "triton", "--engine", str(fp32_engine_sets("tiny-flux").path), "--out",
                      str(tmp_path / "plain"), "--cache", "first-block:0.3")  # fmt: skip
    assert refused.returncode == 2 and "--caches first-block" in refused.stderr
    assert not (tmp_path / "plain").exists()
    written = deploy_triton(cached_sets("tiny-flux"), tmp_path / "repo", TritonDeployConfig(cache="first-block:0.3"))
    model = TritonPythonModel()  # as initialize leaves it, without Triton's process around it
    model.deployment = Deployment.open(written.folder)
    model.pipe = sdtrt.load_pipeline("tiny-flux", engine=written.engine)
    model.stop_file, model.server_pid = None, os.getppid()
    rows = [GenerateRequest(prompt="a cat", steps=10, height=128, width=128)]
    rest = model.pipe.transformer.opened_split().rest
    cached = np.asarray(model.generate(rows).images[0], dtype=np.float64) / 255
    assert rest.calls < 10 and not model.pipe.transformer.is_cache_enabled  # skipped steps; off between requests
    uncached = np.asarray(sdtrt.generate(model.pipe, rows[0]).images[0], dtype=np.float64) / 255
    assert 30 < psnr_db(cached, uncached) < 80


def test_perceptual_scores_read_a_local_clip_model_and_say_what_they_could_not_measure(tmp_path, monkeypatch):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    from sdtrt.tools.image_quality import CLIP_MODEL_ENV, clip_score, perceptual_scores

    tokenizer = CLIPTokenizer.from_pretrained(resolve_model("tiny").path / "tokenizer")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"vocab_size": tokenizer.vocab_size, "hidden_size": 32, "intermediate_size": 37,
                     "num_hidden_layers": 2, "num_attention_heads": 4},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 2, "num_attention_heads": 4},
        projection_dim=16,
    )  # fmt: skip
    CLIPModel(config).save_pretrained(tmp_path)
    CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32), tokenizer).save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    image, other = rng.random((1, 48, 48, 3)), rng.random((1, 48, 48, 3))
    score = clip_score(image, "a cat", str(tmp_path))
    assert 0.0 <= score <= 100.0 and score == pytest.approx(clip_score(image.copy(), "a cat", str(tmp_path)))
    assert score != pytest.approx(clip_score(other, "a cat", str(tmp_path)))  # it reads the image
    monkeypatch.delenv(CLIP_MODEL_ENV, raising=False)
    assert "clip_score" in perceptual_scores(image, other, "a cat")["not_measured"]
    monkeypatch.setenv(CLIP_MODEL_ENV, str(tmp_path))
    scores = perceptual_scores(image, other, "a cat")
    assert scores["clip_score"] == pytest.approx(score, abs=1e-3)
    assert "lpips" in scores or "lpips" in scores["not_measured"]  # measured where the lpips package is installed
