"""The drop-in: real diffusers pipelines with EngineUNet produce the PyTorch pipeline's images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from sdtrt.core.errors import EngineInputError, ModelNotFoundError, RequestError
from sdtrt.pipeline.loading import SCHEDULERS, GenerateRequest, generate, load_pipeline, set_scheduler
from sdtrt.runtime import open_runtime
from sdtrt.standins.unet import EngineUNet
from sdtrt.tools.image_quality import psnr_db

REQUEST = GenerateRequest(prompt="a red fox in the snow", steps=5, height=128, width=192, seed=3)


@pytest.fixture(scope="module")
def reference(tiny):
    return load_pipeline(tiny)


@pytest.fixture(scope="module")
def engine_unet(tiny, tiny_engine):
    return EngineUNet(open_runtime(tiny_engine, tiny), tiny.unet_config(), dtype=torch.float32)


@pytest.mark.parametrize("scheduler", ["pndm", "ddim", "euler", "dpm++"])
def test_text2img_matches_pytorch_under_schedulers(tiny, tiny_engine, scheduler):
    ref = load_pipeline(tiny, scheduler=scheduler)
    eng = load_pipeline(tiny, tiny_engine, scheduler=scheduler)
    assert isinstance(eng.unet, EngineUNet) and type(eng.scheduler) is type(ref.scheduler)
    a = generate(ref, REQUEST, output_type="np").images[0]
    b = generate(eng, REQUEST, output_type="np").images[0]
    psnr = psnr_db(b, a)
    print(f"{scheduler}: PSNR {psnr:.1f} dB")
    assert a.shape == b.shape == (128, 192, 3)
    assert psnr >= 30.0


def test_img2img_matches_pytorch(tiny, tiny_engine):
    ref = load_pipeline(tiny, task="img2img")
    eng = load_pipeline(tiny, tiny_engine, task="img2img")
    init = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    kwargs = dict(prompt="a watercolor", image=init, strength=0.6, num_inference_steps=6, output_type="np")
    a = ref(**kwargs, generator=torch.Generator().manual_seed(1)).images[0]
    b = eng(**kwargs, generator=torch.Generator().manual_seed(1)).images[0]
    assert psnr_db(b, a) >= 30.0


def test_engine_unet_looks_like_the_unet(tiny, reference, engine_unet):
    assert engine_unet.config.in_channels == reference.unet.config.in_channels
    assert engine_unet.config.sample_size == reference.unet.config.sample_size
    assert engine_unet.dtype == torch.float32 and engine_unet.device == torch.device("cpu")
    sample, text = torch.randn(2, 4, 16, 16), torch.randn(2, 77, 32)
    out = engine_unet(sample, 10, text)
    assert isinstance(out, UNet2DConditionOutput) and out.sample.dtype == torch.float32
    (tuple_out,) = engine_unet(sample, 10, text, return_dict=False)
    assert torch.equal(tuple_out, out.sample)
    assert engine_unet(sample.half(), 10, text.half()).sample.dtype == torch.float16, "outputs follow the caller"


@pytest.mark.parametrize(
    "timestep",
    [
        981,
        981.0,
        torch.tensor(981),
        torch.tensor(981.0),
        torch.tensor([981]),
        torch.tensor([981, 981], dtype=torch.int64),
        torch.tensor([981.0, 981.0], dtype=torch.float64),
    ],
    ids=["int", "float", "0d-int64", "0d-float", "[1]", "[B]-int64", "[B]-float64"],
)
def test_every_kind_of_timestep_gives_the_pytorch_result(reference, engine_unet, timestep):
    gen = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 16, 16, generator=gen), torch.randn(2, 77, 32, generator=gen)
    with torch.no_grad():
        expected = reference.unet(sample, 981, text).sample
    got = engine_unet(sample, timestep, text).sample
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.999


def test_wrong_timestep_count(engine_unet):
    with pytest.raises(EngineInputError, match="timestep has 3 values for a batch of 2"):
        engine_unet(torch.randn(2, 4, 16, 16), torch.tensor([1, 2, 3]), torch.randn(2, 77, 32))


def test_wrong_dtypes_and_shapes_are_clear_errors(engine_unet):
    text = torch.randn(2, 77, 32)
    with pytest.raises(EngineInputError, match="floating-point"):
        engine_unet(torch.ones(2, 4, 16, 16, dtype=torch.int64), 1, text)
    with pytest.raises(EngineInputError, match=r"outside the engine's profile \(1, 4, 16, 16\) \.\. \(8, 4, 48, 48\)"):
        engine_unet(torch.randn(2, 4, 64, 64), 1, torch.randn(2, 77, 32))
    with pytest.raises(EngineInputError, match="latent height 17 must be a multiple of 2"):
        engine_unet(torch.randn(2, 4, 17, 17), 1, text)
    with pytest.raises(EngineInputError, match="the engine takes"):
        engine_unet(torch.randn(2, 4, 16, 16), 1, torch.randn(2, 77, 64))
    assert engine_unet(torch.randn(2, 4, 16, 16, dtype=torch.float64), 1, text).sample.dtype == torch.float64


def test_unsupported_extra_inputs_are_refused(engine_unet):
    sample, text = torch.randn(2, 4, 16, 16), torch.randn(2, 77, 32)
    residuals = (torch.zeros(2, 32, 16, 16),)
    with pytest.raises(EngineInputError, match="ControlNet"):
        engine_unet(sample, 1, text, down_block_additional_residuals=residuals)
    with pytest.raises(EngineInputError, match="LoRA"):
        engine_unet(sample, 1, text, cross_attention_kwargs={"scale": 0.5})
    with pytest.raises(TypeError, match="unexpected keyword"):
        engine_unet(sample, 1, text, not_a_unet_input=1)
    assert engine_unet(sample, 1, text, timestep_cond=None, added_cond_kwargs=None).sample.shape == sample.shape


def test_pipeline_needs_a_whole_model_folder(tiny):
    with pytest.raises(ModelNotFoundError, match="bare UNet folder"):
        load_pipeline(str(tiny.path / "unet"))


def test_generate_calls_back_every_step(reference):
    seen = []
    request = GenerateRequest(steps=3, height=128, width=128)
    result = generate(reference, request, on_step=lambda i, total: seen.append((i, total)), output_type="np")
    total = len(reference.scheduler.timesteps)  # PNDM runs one more step than asked
    assert total >= 3 and seen == [(i, total) for i in range(total)]
    assert np.isfinite(result.images).all()


def test_engine_pipeline_defaults_its_size_from_the_unet_config(tiny, tiny_engine):
    """Pipelines derive defaults from the UNet in __init__; the engine must be there by then."""
    eng = load_pipeline(tiny, tiny_engine)
    image = generate(eng, GenerateRequest(steps=2), output_type="np").images[0]
    assert image.shape == (256, 256, 3)  # sample_size 32 × VAE factor 8


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_every_offered_scheduler_generates(tiny, scheduler):
    pipe = load_pipeline(tiny)
    set_scheduler(pipe, scheduler)
    image = generate(pipe, GenerateRequest(steps=2, height=64, width=64), output_type="np").images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all()


def test_a_missing_side_takes_the_model_default_and_sizes_follow_one_rule(reference):
    image = generate(reference, GenerateRequest(steps=1, height=320), output_type="np").images[0]
    assert image.shape == (320, 256, 3), "diffusers alone would reset both sides to 256"
    with pytest.raises(RequestError, match="width 100 is not a positive multiple of 16 pixels"):
        generate(reference, GenerateRequest(steps=1, width=100))
    with pytest.raises(RequestError, match="seed -1 is outside"):
        GenerateRequest(seed=-1)


def test_more_steps_than_the_scheduler_spaces_is_a_request_error(reference):
    # PNDM over 1000 training timesteps: diffusers itself fails with an IndexError inside the loop.
    with pytest.raises(RequestError, match="steps 1001 is more than this scheduler's 1000 timesteps"):
        generate(reference, GenerateRequest(steps=1001, height=64, width=64))


def test_load_pipeline_takes_what_compile_model_returns(tiny, store):
    from sdtrt.tools.compile import compile_model

    result = compile_model(tiny, store, target="onnxruntime")
    pipe = load_pipeline(tiny, result)
    assert isinstance(pipe.unet, EngineUNet) and pipe.unet.runtime.name == "onnxruntime"


def test_requests_with_an_image_input_each_do_not_batch():
    """Every image input is a request's own (one call cannot take one per prompt): Kontext inpainting's
    image_reference too, as the image, mask, control and IP-Adapter images (a pipeline that takes a control
    image needs one in every request: check_inputs)."""
    from PIL import Image

    from sdtrt.pipeline.request import batch_kwargs

    accepts = {"prompt", "num_inference_steps", "height", "width", "num_images_per_prompt", "generator"}
    picture = Image.new("RGB", (64, 64))
    plain = [GenerateRequest("a", steps=2), GenerateRequest("b", steps=2)]
    assert batch_kwargs(plain, accepts)["prompt"] == ["a", "b"]
    for name in ("image_reference", "ip_adapter_image"):
        given = [plain[0], GenerateRequest("b", steps=2, **{name: picture})]
        with pytest.raises(RequestError, match="only text-to-image requests of one image"):
            batch_kwargs(given, accepts | {name})
