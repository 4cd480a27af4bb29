"""FLUX.2 [dev] on an engine set (issue 38): the Mistral3 LLM text encoder, the Flux2 transformer (guidance
embedded) and AutoencoderKLFlux2 each an engine stand-in, images as the PyTorch fp32 Flux2Pipeline's (txt2img and
with a reference image), and a prompt over the LLM engine's tokens refused with one line before anything runs.

One fp32 ONNX Runtime engine set, shared by the module's tests; tiny sizes, two steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.standins.base import EngineModule
from sdtrt.standins.llm_encoder import EngineMistral3
from sdtrt.standins.transformer import EngineFlux2Transformer
from sdtrt.standins.vae_flux2 import EngineFlux2VAE
from sdtrt.tools.image_quality import psnr_db

SIZES = [(128, 128), (128, 192)]


@pytest.fixture(scope="module")
def dev(store):
    """The preset, and its (PyTorch fp32, engine) pipelines."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-flux2")
    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    return source, load_pipeline(source), load_pipeline(source, engine)


def request(**kwargs) -> GenerateRequest:
    return GenerateRequest(**({"prompt": "a red fox in the snow", "steps": 2, "seed": 3} | kwargs))


def images(pipes, req: GenerateRequest) -> list[np.ndarray]:
    return [generate(p, req, output_type="np").images[0] for p in pipes]


def noise_image(height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_every_network_is_an_engine_standin(dev):
    _, reference, engine = dev
    networks = {name: m for name, m in engine.components.items() if isinstance(m, torch.nn.Module)}
    assert set(networks) == {"text_encoder", "transformer", "vae"}
    assert all(isinstance(m, EngineModule) for m in networks.values())
    assert isinstance(engine.text_encoder, EngineMistral3) and isinstance(engine.transformer, EngineFlux2Transformer)
    assert isinstance(engine.vae, EngineFlux2VAE) and engine.vae.encoder_runtime is not None
    assert engine.text_encoder.spec.hidden_layers == (10, 20, 30) and reference.transformer.config.guidance_embeds


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_txt2img_matches_pytorch(dev, size):
    reference, engine = images(dev[1:], request(height=size[0], width=size[1]))
    psnr = psnr_db(engine, reference)
    print(f"tiny-flux2 txt2img {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    assert reference.shape == (*size, 3) and reference.std() > 0.01 and psnr >= 35.0


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_reference_image_matches_pytorch(dev, size):
    """The editing task: a reference image, encoded by the VAE encoder engine, joins the transformer's tokens."""
    image = noise_image(128, 128)
    reference, engine = images(dev[1:], request(height=size[0], width=size[1], image=image))
    plain = generate(dev[1], request(height=size[0], width=size[1]), output_type="np").images[0]
    psnr = psnr_db(engine, reference)
    print(f"tiny-flux2 reference image {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    assert psnr >= 35.0 and psnr_db(plain, reference) < psnr - 40.0


def test_a_prompt_over_the_llm_engines_tokens_is_refused_before_running(dev):
    _, _, engine = dev
    calls = []
    for network in (engine.text_encoder, engine.transformer):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(RequestError, match="tokens with its chat template") as error:
        generate(engine, request(prompt="astronaut " * 600, height=128, width=128))
    assert "\n" not in str(error.value) and not calls


def test_the_vision_path_and_generation_are_refused(dev):
    """Only Flux2Pipeline's prompt upsampling reaches the vision tower, through generate: refused in one line."""
    _, _, engine = dev
    ids = torch.ones(1, 32, dtype=torch.int64)
    out = engine.text_encoder(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    assert out.hidden_states[30].shape == (1, 32, 32)
    for call in (
        lambda: engine.text_encoder.generate(ids),
        lambda: engine.text_encoder(ids, pixel_values=torch.zeros(1, 3, 16, 16), output_hidden_states=True),
    ):
        with pytest.raises(EngineInputError, match=r"^[^\n]+$"):
            call()
