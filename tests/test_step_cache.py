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
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS
from diffusers.models.cache_utils import CacheMixin

import sdtrt
from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import ConfigError, EngineInputError
from sdtrt.core.trt_products import rtx_missing
from sdtrt.lora.files import random_lora
from sdtrt.pipeline.step_cache import StepCache, engines_problem
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import component_spec
from sdtrt.spec.transformer_split import TransformerPartSpec, part_class
from sdtrt.stages.graph_module import graph_module
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db, ssim

STEPS = 10
CALL = {"num_inference_steps": STEPS, "height": 128, "width": 128, "output_type": "np"}
PARTS = ("transformer_embed", "transformer_first_block", "transformer_rest", "transformer_out")


def generate(pipe, config=None, context=contextlib.nullcontext, **call) -> np.ndarray:
    if config is not None:
        pipe.transformer.enable_cache(config)
    try:
        with context():
            return pipe("a cat", generator=torch.Generator().manual_seed(0), **CALL, **call).images
    finally:
        if config is not None:
            pipe.transformer.disable_cache()


SPLIT_PRESETS = ("tiny-flux", "tiny-flux-schnell", "tiny-sd3", "tiny-qwen-image", "tiny-flux2-klein", "tiny-flux2")


@pytest.mark.parametrize(
    ("preset", "blocks"),
    [(p, {}) for p in SPLIT_PRESETS]
    + [("tiny-flux2-klein", {"num_layers": 3, "num_single_layers": 2})],  # double-stream blocks in the other blocks'
)  # part too, as in the real klein's 5 + 20
def test_the_parts_chained_compute_the_whole_transformer(preset, blocks, tmp_path):
    from sdtrt.sources.preset_build import with_network_config

    model = resolve_model(preset)
    if blocks:
        model = resolve_model(str(with_network_config(model.path, "transformer", tmp_path / "grown", **blocks)))
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
    with pytest.raises(ConfigError, match="no enable_cache"):
        compile_model(resolve_model("tiny-zimage"), store, "onnxruntime", caches=("first-block",))
    on_pytorch = engines_problem(StepCache.parse("first-block"), None, resolve_model("tiny-zimage"))
    assert on_pytorch and on_pytorch.endswith(
        "ZImageTransformer2DModel has no enable_cache; sdtrt builds no step cache for it"
    )
    on_engines = engines_problem(StepCache.parse("taylorseer:2"), {}, resolve_model("tiny-zimage"))
    assert on_engines == (
        "--cache taylorseer: sdtrt builds no step cache for a ZImageTransformer2DModel; generate without --cache"
    )  # not "recompile it with --caches", which compile refuses for it


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
    assert " --target onnxruntime " in reproduce, "auto would build TensorRT sets on a GPU machine"
    for component in PARTS:
        spec = artifact_spec(members[component])
        assert type(spec) is part_class(component, "FluxTransformer2DModel")
        assert spec == component_spec(resolve_model("tiny-flux"), component, "fp32")


def test_a_cache_option_parses_to_its_kind_and_setting():
    assert StepCache.parse("taylorseer") == StepCache("taylorseer", 5.0)  # each kind's default without a value
    assert StepCache.parse("deepcache") == StepCache("deepcache", 3.0)
    assert StepCache.parse("first-block:0.08") == StepCache("first-block", 0.08)
    refused = {"deepcache:0": "1 or more", "taylorseer:2.5": "whole number", "first-block:": "not a number",
               "magcache:-1": "over 0", "teacache": "unknown step cache"}  # fmt: skip
    for text, why in refused.items():
        with pytest.raises(ConfigError, match=why):
            StepCache.parse(text)


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
@pytest.mark.parametrize(
    ("preset", "members", "layer_type"),
    [
        pytest.param("tiny-flux", PARTS, "HALF", id="flux"),
        pytest.param("tiny", ("unet_deep", "unet_shallow"), "HALF", id="deepcache"),
        # compile's fp16 builds Qwen-Image's transformer in bf16 (QwenImageTransformerSpec.fp16_problem): its parts too
        pytest.param("tiny-qwen-image", PARTS, "BF16", id="qwen-image", marks=pytest.mark.slow),
        # FLUX.2's: its blocks' modulations and the rotary tokens, widened by the profile's reference, profiled
        pytest.param("tiny-flux2-klein", PARTS, "HALF", id="flux2-klein", marks=pytest.mark.slow),
    ],
)
def test_the_split_members_build_as_tensorrt_rtx_plans(store, preset, members, layer_type):
    """The TensorRT build path the two products share, run for real on the split members in the precision
    ``compile --precision fp16`` exports them in: Flux's and FLUX.2's four parts and DeepCache's two in fp16,
    Qwen-Image's four in bf16."""
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.stages import export, simplify
    from sdtrt.tools.compile import build, component_precision

    model = resolve_model(preset)
    for component in members:
        config = ExportConfig(
            component=component, precision=component_precision(model, component, "fp16", "tensorrt-rtx")
        )
        graph = simplify.run(SimplifyConfig(), export.run(config, model, store), store)
        plan, _ = build(graph, store, "tensorrt-rtx")
        details = plan.manifest["details"]
        assert details["layer_types"].get(layer_type), details["layers"]  # built in the graph's precision
        assert (plan.path / plan.manifest["primary"]).stat().st_size > 0
