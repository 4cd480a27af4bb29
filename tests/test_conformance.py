"""Engine pipelines hold up to what a user's script does around the call (issue 23), on SD 1.x and SDXL sets.

Each behaviour is checked on the tiny presets with a PyTorch pipeline beside the engine one: types
(isinstance of diffusers' classes), ``to(dtype)``, VAE slicing and tiling, the methods that would
change the network (FreeU, attention processors, IP-Adapter, layerwise casting), and save/load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionXLImg2ImgPipeline,
    UNet2DConditionModel,
)
from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from sdtrt.core.errors import ArtifactError, EngineInputError
from sdtrt.pipeline.loading import load_pipeline
from sdtrt.sources.models import resolve_model
from sdtrt.standins.base import EngineModule

PRESETS = ("tiny", "tiny-sdxl")
CALL = dict(prompt="a lighthouse at dusk", num_inference_steps=2, height=128, width=128)


@pytest.fixture(scope="module", params=PRESETS)
def pipes(request, fp32_engine_sets):
    """(PyTorch pipeline, engine pipeline) of one preset."""
    model = resolve_model(request.param)
    return load_pipeline(model), load_pipeline(model, fp32_engine_sets(request.param))


def image(pipe, **kwargs):
    args = CALL | {"output_type": "np"} | kwargs
    return pipe(**args, generator=torch.Generator().manual_seed(0)).images


def test_standins_are_instances_of_the_classes_they_stand_for(pipes):
    ref, eng = pipes
    assert isinstance(eng.unet, UNet2DConditionModel) and isinstance(eng.vae, AutoencoderKL)
    assert isinstance(eng.text_encoder, CLIPTextModel)
    if "text_encoder_2" in eng.components:
        assert isinstance(eng.text_encoder_2, CLIPTextModelWithProjection)
    for name, module in eng.components.items():
        if isinstance(module, EngineModule):
            assert eng.config[name] == ref.config[name], "model_index.json names the PyTorch class"
    np.testing.assert_allclose(image(eng), image(ref), atol=1e-4)


def test_to_a_dtype_changes_what_the_pipeline_computes_in(pipes):
    ref, eng = pipes
    before = image(eng)
    eng.to(torch.float16)
    try:
        assert eng.dtype == torch.float16
        assert all(m.dtype == torch.float16 for m in eng.components.values() if isinstance(m, EngineModule))
        latents = eng(**CALL, output_type="latent", generator=torch.Generator().manual_seed(0)).images
        assert latents.dtype == torch.float16, "never silently fp32"
        half = image(eng)
        assert not np.array_equal(half, before)
        np.testing.assert_allclose(half, image(ref), atol=2e-2)
    finally:
        eng.to(torch.float32)
    np.testing.assert_array_equal(image(eng), before)


def test_to_another_device_or_a_non_float_dtype_is_refused(pipes):
    _, eng = pipes
    with pytest.raises(EngineInputError, match=r"runs on its engine's device \(cpu\) and cannot move to cuda"):
        eng.unet.to("cuda")
    with pytest.raises(EngineInputError, match=r"floating-point tensors, not torch\.int8"):
        eng.vae.to(torch.int8)
    eng.to("cpu")  # where it is: nothing to do


def test_vae_slicing_and_tiling_decode_as_the_pytorch_vae_does(pipes):
    ref, eng = pipes
    latents = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(1))  # 512², over the profile
    with pytest.raises(EngineInputError, match="outside"):
        eng.vae.decode(latents)
    for vae in (ref.vae, eng.vae):
        vae.enable_slicing()
        vae.enable_tiling()
    try:
        assert eng.vae.tile_latent_min_size == ref.vae.tile_latent_min_size == 32  # inside the 16..48 profile
        with torch.no_grad():
            expected = ref.vae.decode(latents).sample
        got = eng.vae.decode(latents).sample
        assert got.shape == expected.shape == (2, 3, 512, 512)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        eng.vae.disable_tiling()
        small = latents[:, :, :24, :24]
        sliced = eng.vae.decode(small).sample  # one engine call per image
        eng.vae.disable_slicing()
        torch.testing.assert_close(sliced, eng.vae.decode(small).sample, atol=1e-5, rtol=0)
    finally:
        for vae in (ref.vae, eng.vae):
            vae.disable_slicing()
            vae.disable_tiling()


def test_an_edge_tile_under_the_profile_runs_on_pytorch_and_the_decode_is_exact(pipes):
    ref, eng = pipes
    latents = torch.randn(1, 4, 40, 68, generator=torch.Generator().manual_seed(2))  # last tile column: 68-48=20
    eng.vae.enable_tiling()
    ref.vae.enable_tiling()
    try:
        with torch.no_grad():
            expected = ref.vae.decode(latents).sample
        got = eng.vae.decode(latents).sample
    finally:
        eng.vae.disable_tiling()
        ref.vae.disable_tiling()
    assert got.shape == expected.shape == (1, 3, 320, 544)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)  # padding it instead was off by up to 3.0


def test_attention_methods_an_engine_already_does_are_no_ops(pipes):
    _, eng = pipes
    before = image(eng)
    eng.fuse_qkv_projections()
    np.testing.assert_array_equal(image(eng), before)
    eng.unfuse_qkv_projections()
    eng.unet.set_default_attn_processor()
    eng.vae.set_default_attn_processor()
    eng.unet.set_attn_processor(AttnProcessor2_0())
    assert eng.unet.attn_processors == {}
    eng.disable_freeu()
    np.testing.assert_array_equal(image(eng), before)


def test_methods_that_change_the_network_raise_one_line_naming_the_feature(pipes):
    _, eng = pipes
    cases = [
        (lambda: eng.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4), "FreeU"),
        (lambda: eng.unet.set_attn_processor(IPAdapterAttnProcessor2_0(32, 32)), "IPAdapterAttnProcessor2_0"),
        (lambda: eng.unet._load_ip_adapter_weights([{}]), "recompile with `sdtrt compile --ip-adapter PATH`"),
        (lambda: eng.unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn), "enable_layerwise_casting"),
        (lambda: eng.vae.enable_group_offload(torch.device("cpu")), "enable_group_offload"),
    ]
    for call, feature in cases:
        with pytest.raises(EngineInputError, match=feature) as caught:
            call()
        assert "\n" not in str(caught.value)


def test_save_pretrained_writes_the_pytorch_model_and_the_engine_record(pipes, tmp_path):
    ref, eng = pipes
    components_before = {name: eng.config[name] for name in eng.components}
    eng.save_pretrained(tmp_path / "saved")
    assert {name: eng.config[name] for name in eng.components} == components_before, "the live pipeline's stays"
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"] and index["vae"] == ["diffusers", "AutoencoderKL"]
    record = json.loads((tmp_path / "saved" / "unet" / "sdtrt_engine.json").read_text())
    assert set(record["engines"]) == {"unet"}

    pytorch = DiffusionPipeline.from_pretrained(tmp_path / "saved")
    pytorch.set_progress_bar_config(disable=True)
    assert type(pytorch.unet) is UNet2DConditionModel
    np.testing.assert_array_equal(image(pytorch), image(ref))
    again = load_pipeline(str(tmp_path / "saved"))
    assert isinstance(again.unet, EngineModule) and isinstance(again.vae, EngineModule)
    np.testing.assert_array_equal(image(again), image(eng))

    eng.save_pretrained(tmp_path / "variant", variant="fp16")
    assert (tmp_path / "variant" / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    DiffusionPipeline.from_pretrained(tmp_path / "variant", variant="fp16")


def test_from_pretrained_takes_a_standin(pipes):
    _, eng = pipes
    model = resolve_model("tiny-sdxl" if "text_encoder_2" in eng.components else "tiny")
    mixed = type(eng).from_pretrained(model.path, unet=eng.unet, vae=eng.vae)
    assert mixed.unet is eng.unet and mixed.vae is eng.vae


def test_a_standin_made_without_its_model_folder_cannot_save(pipes, tmp_path):
    _, eng = pipes
    unet = type(eng.unet)(eng.unet.runtime, dict(eng.unet.config))
    with pytest.raises(ArtifactError, match="made without its model folder"):
        unet.save_pretrained(tmp_path / "unet")
    assert not (tmp_path / "unet").exists()


def test_from_pipe_carries_the_engines_over(pipes, tmp_path):
    ref, eng = pipes
    sdxl = "text_encoder_2" in eng.components
    img2img = StableDiffusionXLImg2ImgPipeline if sdxl else StableDiffusionImg2ImgPipeline
    other, expected = img2img.from_pipe(eng), img2img.from_pipe(ref)
    for name, module in eng.components.items():
        if isinstance(module, EngineModule):
            assert other.components[name] is module
            assert other.config[name] == ref.config[name], "model_index.json names the PyTorch class"
    start = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(
        image(other, image=start, strength=0.6), image(expected, image=start, strength=0.6), atol=1e-4
    )
    other.save_pretrained(tmp_path / "img2img")
    assert type(DiffusionPipeline.from_pretrained(tmp_path / "img2img").unet) is UNet2DConditionModel


def test_a_pipeline_built_from_standins_saves_as_pytorch_and_loads_back_on_engines(pipes, tmp_path):
    ref, eng = pipes
    built = type(eng)(**eng.components)  # as diffusers' own tests and users' scripts build pipelines
    for name, module in eng.components.items():
        if isinstance(module, EngineModule):
            assert built.config[name] == ref.config[name], "recorded as the PyTorch class"
    built.save_pretrained(tmp_path / "built")
    pytorch = DiffusionPipeline.from_pretrained(tmp_path / "built")
    pytorch.set_progress_bar_config(disable=True)
    assert type(pytorch.vae) is AutoencoderKL and type(pytorch.text_encoder) is CLIPTextModel
    np.testing.assert_allclose(image(pytorch), image(ref), atol=1e-6)
    again = load_pipeline(str(tmp_path / "built"))
    assert isinstance(again.unet, EngineModule)
    np.testing.assert_array_equal(image(again), image(eng))
