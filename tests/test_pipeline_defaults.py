"""A drop-in takes the pipeline's own defaults: engines built with sdtrt's default profiles answer the call
``pipe("a prompt")`` makes, whatever diffusers passes when nothing is asked."""

from __future__ import annotations

import inspect

import diffusers
import numpy as np
import pytest

from sdtrt.sources.presets import PRESETS

TINY = [name for name in PRESETS if name.startswith("tiny")]


@pytest.mark.parametrize("preset", TINY)
def test_default_profiles_cover_what_the_pipeline_passes_by_default(preset):
    """The set's profile (the denoiser's, which compile gives every member) and each T5 engine's own default take the
    images per prompt and the T5 token count (max_sequence_length) the family's pipeline passes when not told."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.spec import component_spec, denoiser_spec, model_components

    model = resolve_model(preset)
    defaults = inspect.signature(getattr(diffusers, model.pipeline_class()).__call__).parameters
    profiles = [denoiser_spec(model).default_profile()]
    profiles += [component_spec(model, c).default_profile() for c in model_components(model) if c != "vae_encoder"]
    for profile in profiles:
        assert profile.batch.min <= defaults["num_images_per_prompt"].default <= profile.batch.max
    if "max_sequence_length" in defaults:
        tokens = defaults["max_sequence_length"].default
        for profile in profiles:
            assert profile.tokens is None or profile.tokens.min <= tokens <= profile.tokens.max, (preset, profile)
        assert denoiser_spec(model).default_profile().tokens is not None


def test_a_schnell_set_answers_the_pipelines_default_call(fp32_engine_sets):
    """FluxPipeline passes max_sequence_length=512 by default; schnell's engines are tuned for 256 T5 tokens and
    must still take 512 (they refused it with EngineInputError)."""
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.pipeline.request import SizeRule
    from sdtrt.sources.models import resolve_model

    model = resolve_model("tiny-flux-schnell")
    pipe = load_pipeline(model, fp32_engine_sets("tiny-flux-schnell"))
    # FluxPipeline's default size is the real models' 1024 px (its default_sample_size is fixed), not the tiny one's.
    height, width = SizeRule.for_model(model).resolve(None, None)
    image = pipe("a prompt", num_inference_steps=1, height=height, width=width, output_type="np").images[0]
    assert image.shape == (height, width, 3) and np.isfinite(image).all()
