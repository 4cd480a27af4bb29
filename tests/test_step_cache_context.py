"""Step caches in pipelines that open no cache context: diffusers' cache hooks need one, and only some pipelines'
``__call__`` opens it (``opens_cache_context`` reads their code). For the others sdtrt's ``generate`` runs the call
inside the transformer's "cond" context (they call the transformer once a step, so that is diffusers' own reference),
and refuses true CFG there (two transformer calls a step would share one cache state)."""

from __future__ import annotations

import contextlib

import diffusers
import numpy as np
import pytest
from diffusers.hooks import FirstBlockCacheConfig
from PIL import Image

from sdtrt.core.errors import EngineInputError
from sdtrt.core.families import PIPELINE_TASKS
from sdtrt.pipeline.loading import generate, load_pipeline
from sdtrt.pipeline.request import GenerateRequest
from sdtrt.pipeline.step_cache import StepCache, cache_call_context, enable_step_cache, opens_cache_context
from sdtrt.sources.models import resolve_model
from sdtrt.spec.transformer_split import splits
from sdtrt.tools.image_quality import psnr_db

# diffusers 0.42.1's pipelines (of those sdtrt runs, with a transformer it splits) that open "cond"/"uncond".
OPENING = {"FluxPipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline"}


def split_transformer_pipelines() -> list[str]:
    """The PIPELINE_TASKS classes whose transformer sdtrt splits for step caches."""
    import inspect

    names = []
    for name in (c for row in PIPELINE_TASKS for c in row.values()):
        transformer = inspect.signature(getattr(diffusers, name).__init__).parameters.get("transformer")
        if transformer is not None and splits(getattr(transformer.annotation, "__name__", transformer.annotation)):
            names.append(name)
    return names


def test_which_pipelines_open_a_cache_context_is_read_from_their_code():
    names = split_transformer_pipelines()
    assert {"StableDiffusion3Pipeline", "FluxKontextPipeline", "Flux2Pipeline", "QwenImagePipeline"} <= set(names)
    opening = {n for n in names if opens_cache_context(getattr(diffusers, n))}
    assert opening == OPENING | {n for n in names if n.startswith("QwenImage")}, opening


@pytest.fixture(scope="module")
def img2img():
    """tiny-flux's PyTorch FluxImg2ImgPipeline (opens no cache context) and a 2-step request."""
    pipe = load_pipeline(resolve_model("tiny-flux"), task="img2img")
    start = Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 128, 3), dtype=np.uint8))
    return pipe, GenerateRequest("a cat", None, 2, 3.5, 0, 128, 128, strength=0.9, image=start)


def test_a_cache_in_a_pipeline_without_a_context_runs_in_cond_as_diffusers_hooks_there(img2img):
    """generate --task img2img --cache first-block raised diffusers' "No cache context is set"; now it runs, and its
    image is diffusers' hooks inside an explicit outer "cond" context, bit for bit, and not the uncached one."""
    pipe, request = img2img
    uncached = generate(pipe, request, output_type="np").images
    enable_step_cache(pipe, StepCache("first-block", 1.0), request.steps)
    try:
        cached = generate(pipe, request, output_type="np").images
    finally:
        pipe.transformer.disable_cache()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    try:
        with pytest.raises(ValueError, match="No cache context is set"):  # diffusers alone: the old crash
            pipe(**kwargs_of(request))
        with pipe.transformer.cache_context("cond"):
            expected = pipe(**kwargs_of(request)).images
    finally:
        pipe.transformer.disable_cache()
    psnr = psnr_db(cached, uncached)
    print(f"tiny-flux img2img first-block:1, 2 steps: {psnr:.1f} dB vs uncached")
    assert np.array_equal(cached, expected) and psnr < 80.0


def kwargs_of(request: GenerateRequest) -> dict[str, object]:
    import torch

    return {
        "prompt": request.prompt, "image": request.image, "strength": request.strength, "height": 128, "width": 128,
        "num_inference_steps": request.steps, "guidance_scale": request.guidance, "output_type": "np",
        "generator": torch.Generator().manual_seed(request.seed),
    }  # fmt: skip


def test_true_cfg_with_a_cache_in_a_pipeline_without_a_context_is_refused_in_one_line(img2img):
    pipe, _ = img2img
    controlnet = diffusers.FluxControlNetPipeline(**{k: None for k in ("scheduler", "vae", "text_encoder", "tokenizer",
        "text_encoder_2", "tokenizer_2", "controlnet")}, transformer=pipe.transformer)  # fmt: skip
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    try:
        for each in (pipe, controlnet):
            with pytest.raises(EngineInputError, match="true CFG") as refused:
                cache_call_context(each, {"negative_prompt": "blurry", "true_cfg_scale": 4.0})
            assert "\n" not in str(refused.value) and type(each).__name__ in str(refused.value)
            # true_cfg_scale 1: one transformer call a step, run in "cond"
            assert not isinstance(cache_call_context(each, {"negative_prompt": "blurry"}), contextlib.nullcontext)
    finally:
        pipe.transformer.disable_cache()


def test_true_cfg_on_cached_engines_without_a_context_is_refused_at_the_second_call(cached_sets, img2img):
    """A call of the pipeline itself (no generate to check its arguments first): the engine transformer refuses the
    step's second call, the negative prompt's, in one line; a call without true CFG runs."""
    import sdtrt

    engines = sdtrt.load_pipeline("tiny-flux", engine=cached_sets("tiny-flux"), task="img2img")
    _, request = img2img
    engines.transformer.enable_cache(FirstBlockCacheConfig(threshold=1.0))
    try:
        with pytest.raises(EngineInputError, match="twice at one step") as refused:
            engines(**kwargs_of(request), negative_prompt="blurry", true_cfg_scale=4.0)
        assert "\n" not in str(refused.value)
        assert engines(**kwargs_of(request), negative_prompt="blurry").images.shape == (1, 128, 128, 3)
    finally:
        engines.transformer.disable_cache()
