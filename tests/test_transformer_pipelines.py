"""SD3 / Flux.1 dev / schnell pipelines on engine sets (issue 20): every network an engine stand-in, images as
the PyTorch fp32 pipeline's, and bad requests refused with one line before anything runs.

One fp32 ONNX Runtime engine set per family, shared by the module's tests; tiny sizes, two or three steps.
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import generate, load_pipeline
from sdtrt.pipeline.request import FLOW_SCHEDULERS, NOT_FOR_FLUX
from sdtrt.standins.base import EngineModule
from sdtrt.standins.text_encoders import EngineT5
from sdtrt.standins.transformer import EngineTransformer
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import Family, assert_images_match

FAMILIES = ("tiny-sd3", "tiny-flux", "tiny-flux-schnell")
# What each family is asked with: SD3 a negative prompt, Flux dev guidance 3.5, schnell nothing more.
EXTRA = {"tiny-sd3": {"negative_prompt": "blurry"}, "tiny-flux": {"guidance": 3.5}, "tiny-flux-schnell": {}}
LONG_PROMPT = "a photo of an astronaut riding a horse on the moon, " * 5  # over 77 CLIP tokens, under 256 T5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, store):
    return Family(request.param, store, EXTRA[request.param])


def test_every_network_is_an_engine_standin(family):
    _, engine = family.pipelines()
    networks = {name: m for name, m in engine.components.items() if isinstance(m, torch.nn.Module)}
    assert networks and all(isinstance(m, EngineModule) for m in networks.values()), networks
    t5 = engine.text_encoder_3 if family.name == "tiny-sd3" else engine.text_encoder_2
    assert isinstance(engine.transformer, EngineTransformer) and isinstance(t5, EngineT5)
    assert isinstance(engine.transformer, getattr(diffusers, engine.transformer.config._class_name))


@pytest.mark.parametrize("size", [(128, 128), (128, 192)], ids=["square", "non-square"])
def test_txt2img_matches_pytorch(family, size):
    assert_images_match(family, family.request(height=size[0], width=size[1]))


def test_a_prompt_over_77_tokens_reaches_t5_whole(family):
    reference, _ = family.pipelines()
    clip, t5 = reference.tokenizer, reference.tokenizer_3 if family.name == "tiny-sd3" else reference.tokenizer_2
    assert len(clip(LONG_PROMPT).input_ids) > 77 and len(t5(LONG_PROMPT).input_ids) > 77
    assert_images_match(family, family.request(prompt=LONG_PROMPT, height=128, width=128))


def test_img2img_matches_pytorch(family):
    init = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    assert_images_match(family, family.request(image=init, strength=0.7, steps=3, height=128, width=128), "img2img")


def test_bad_requests_fail_with_one_line_before_running(family):
    _, engine = family.pipelines()
    calls = []
    engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    too_long = "astronaut " * 600  # more T5 tokens than the engines' profile
    bad = [family.request(prompt=too_long, height=128, width=128)]
    if family.name != "tiny-sd3":
        bad.append(family.request(height=136, width=128))  # on the 8-px grid, off Flux's 16-px one
        bad.append(family.request(negative_prompt="blurry", height=128, width=128))  # FluxPipeline would ignore it
    if family.name == "tiny-flux-schnell":
        bad.append(family.request(guidance=3.5, height=128, width=128))
    for request in bad:
        with pytest.raises(RequestError) as error:
            generate(engine, request)
        assert "\n" not in str(error.value)
    assert not calls


def test_what_the_engine_cannot_do_is_refused(family):
    _, engine = family.pipelines()
    transformer, spec = engine.transformer, engine.transformer.spec
    inputs = spec.sample_inputs(1 + spec.doubles_batch, 128, 128, tokens=32)
    out = transformer(**inputs)
    assert isinstance(out, Transformer2DModelOutput) and out.sample.dtype == torch.float32
    refused = [
        {"joint_attention_kwargs": {"scale": 0.5}},
        {"skip_layers": [1]} if family.name == "tiny-sd3" else {"controlnet_block_samples": [inputs["hidden_states"]]},
    ]
    for kwargs in refused:
        with pytest.raises(EngineInputError):
            transformer(**inputs, **kwargs)
    t5 = engine.text_encoder_3 if family.name == "tiny-sd3" else engine.text_encoder_2
    ids = torch.ones(1, 32, dtype=torch.int64)
    assert t5(ids).last_hidden_state.shape[:2] == (1, 32) and torch.equal(t5(ids, return_dict=False)[0], t5(ids)[0])
    with pytest.raises(EngineInputError):
        t5(ids, attention_mask=torch.ones_like(ids))


def test_saved_engine_pipeline_loads_on_its_engines(family, tmp_path):
    _, engine = family.pipelines()
    engine.save_pretrained(tmp_path / "saved")
    again = load_pipeline(str(tmp_path / "saved"))
    assert isinstance(again.transformer, EngineTransformer)
    request = family.request(height=128, width=128)
    a, b = (generate(p, request, output_type="np").images[0] for p in (engine, again))
    assert (a == b).all()


def test_loras_match_diffusers_fused_pipeline_and_switch_without_rebuild(family, tmp_path):
    """A LoRA put into the transformer engine's weights (no rebuild) gives diffusers' load_lora_weights + fuse_lora
    image; A → B → A gives A's image bit for bit (weights always come from the base); clearing gives the base's."""
    from sdtrt.lora.files import random_lora
    from sdtrt.pipeline.loading import set_loras

    _, engine = family.pipelines()
    request = family.request(height=128, width=128)
    base = generate(engine, request, output_type="np").images[0]
    lora = random_lora(family.source, tmp_path / "lora.safetensors", rank=4, alpha=8, seed=5)
    fused = load_pipeline(family.source, loras=[(lora, 0.8)])
    try:
        set_loras(engine, [(lora, 0.8)])
        want, got = (generate(p, request, output_type="np").images[0] for p in (fused, engine))
        set_loras(engine, [(lora, 0.3)])
        set_loras(engine, [(lora, 0.8)])
        again = generate(engine, request, output_type="np").images[0]
    finally:
        set_loras(engine, [])
    assert psnr_db(got, want) >= 35.0 and psnr_db(base, want) < 35.0  # the LoRA changes the image, and it matches
    assert (again == got).all()
    assert psnr_db(generate(engine, request, output_type="np").images[0], base) >= 80.0


def test_inpaint_matches_pytorch(family):
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8))
    mask = np.zeros((128, 128), dtype=np.uint8)
    mask[32:96, 32:96] = 255  # white is repainted
    request = family.request(
        image=image, mask_image=Image.fromarray(mask), strength=0.8, steps=3, height=128, width=128
    )
    assert_images_match(family, request, "inpaint")


@pytest.mark.parametrize("scheduler", ["flow-euler", "flow-heun"])
def test_flow_schedulers_drive_the_engine_set(family, scheduler):
    """The flow-matching schedulers a family's pipeline takes run it on engines as on PyTorch (flow-heun: SD3 only)."""
    if family.name != "tiny-sd3" and scheduler in NOT_FOR_FLUX:
        with pytest.raises(RequestError, match=f"scheduler '{scheduler}' cannot drive a flow-matching"):
            load_pipeline(family.source, family.engine, scheduler=scheduler)
        return
    pipes = [load_pipeline(family.source, engine, scheduler=scheduler) for engine in (None, family.engine)]
    request = family.request(height=128, width=128)
    reference, engine = (generate(p, request, output_type="np").images[0] for p in pipes)
    assert type(pipes[1].scheduler).__name__ == FLOW_SCHEDULERS[scheduler] and reference.std() > 0.01
    assert psnr_db(engine, reference) >= 35.0


def test_every_text_encoder_is_timed(family):
    """bench's and profile's "text_encoder" spans cover CLIP-L, CLIP-G and T5, not only the first encoder."""
    from sdtrt.core.config import TEXT_ENCODERS
    from sdtrt.tools.bench import breakdown
    from sdtrt.tools.trace import Tracer, instrument_pipeline

    _, engine = family.pipelines()
    tracer = Tracer()
    with instrument_pipeline(engine, tracer) as steps:
        generate(engine, family.request(height=128, width=128, steps=1), on_step=steps.step_ended)
    spans = [s for s in tracer.spans() if s.category == "text_encoder"]
    assert {s.name for s in spans} == {n for n in TEXT_ENCODERS if getattr(engine, n, None) is not None}
    assert breakdown(tracer.spans())["text_encoder"] == pytest.approx(sum(s.seconds for s in spans))
