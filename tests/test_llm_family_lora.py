"""LoRAs without a rebuild on Z-Image's, Qwen-Image's and FLUX.2 [dev]'s transformers (issue 38, item 4).

The engine pipelines are the fp32 ONNX Runtime sets test_zimage, test_qwen_image and test_flux2_dev build (cache hits
in a run; dev's a minute to build, so its cases are slow, as its own module's engine tests). Each
takes a random diffusers LoRA (``random_lora``, as `sdtrt lora random` makes them) through ``set_loras`` and diffusers'
LoRA API; its image is checked against diffusers' PyTorch fp32 pipeline with ``load_lora_weights`` + ``fuse_lora``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sdtrt.core.errors import LoraError, LoraFamilyError
from sdtrt.lora.files import random_lora, read_lora
from sdtrt.lora.refit import coverage
from sdtrt.pipeline.loading import generate, set_loras
from sdtrt.sources.models import load_folder
from sdtrt.tools.image_quality import psnr_db

from .helpers import run_cli
from .test_flux2_dev import dev, source
from .test_new_transformer_lora import bfl_lora, fused_reference, lora_file
from .test_qwen_image import qwen
from .test_qwen_image import request as qwen_request
from .test_zimage import request as zimage_request
from .test_zimage import zimage

__all__ = ["dev", "qwen", "source", "zimage"]  # the fixtures, imported to be found here
LABELS = {"zimage": "Z-Image", "qwenimage": "Qwen-Image", "flux2": "FLUX.2"}


@pytest.fixture(scope="module", params=["zimage", "qwen", pytest.param("dev", marks=pytest.mark.slow)])
def family(request, tmp_path_factory):
    """(label, family, source, PyTorch pipeline, engine pipeline, a request, two LoRAs A and B)."""
    if request.param == "zimage":
        source, _, (reference, engine) = request.getfixturevalue("zimage")
        call = zimage_request("txt2img", (128, 192))
    elif request.param == "qwen":
        source, reference, engine = request.getfixturevalue("qwen")
        call = qwen_request(height=128, width=192)
    else:  # FLUX.2 [dev]: klein's transformer class at another size, its LoRAs read by Flux2Pipeline's loader
        source, reference, engine = request.getfixturevalue("dev")
        call = zimage_request("txt2img", (128, 192))  # a text-to-image request: prompt, 2 steps, seed 3
    folder = tmp_path_factory.mktemp(f"{request.param}-loras")
    loras = [str(random_lora(source, folder / f"{ab}.safetensors", rank=4, alpha=8, seed=seed))
             for ab, seed in (("a", 1), ("b", 2))]  # fmt: skip
    if request.param == "dev":  # B in kohya's BFL names, which diffusers' FLUX.2 loader converts
        loras[1] = bfl_lora(load_folder(source, "transformer"), folder / "b.safetensors", "kohya", seed=2)
    return source, reference, engine, call, loras


def image(pipe, call) -> np.ndarray:
    return generate(pipe, call, output_type="np").images[0]


def test_loras_match_diffusers_fused_and_switch_a_b_a_exactly(family):
    source, reference, engine, call, (a, b) = family
    set_loras(engine, [])
    base = image(engine, call)
    given = [(a, 0.8), (b, 0.5)]
    set_loras(engine, given)
    try:
        got = image(engine, call)
    finally:
        set_loras(engine, [])
    want = fused_reference(reference, given, lambda pipe: image(pipe, call))
    psnr = psnr_db(got, want)
    print(f"{source.name} LoRA A+B 128x192: PSNR {psnr:.1f} dB against diffusers' fused")
    assert psnr >= 35.0 and psnr_db(got, base) < psnr - 20.0  # the LoRAs move the image far more than engines differ
    engine.load_lora_weights(a, adapter_name="a")
    engine.load_lora_weights(b, adapter_name="b")
    engine.set_adapters(["a"], [0.8])
    with_a = image(engine, call)
    engine.set_adapters(["b"], [0.8])
    with_b = image(engine, call)
    engine.set_adapters(["a"], [0.8])
    assert np.array_equal(image(engine, call), with_a) and not np.array_equal(with_a, with_b)
    set_loras(engine, [])
    assert np.array_equal(image(engine, call), base)


def test_weight_map_places_every_lora_module(family):
    source, _, engine, _, (a, _) = family
    lora = read_lora(a, source.family())
    assert lora.family == LABELS[source.family()]
    assert read_lora(a).family == lora.family  # `sdtrt lora inspect` without a model reads it the same
    made = engine.transformer.loras.weight_map()
    assert made.unmapped == {}
    placed = {name.removesuffix(".weight") for name in {*made.mapped, *made.unread}}
    assert set(lora.parts["transformer"]) <= placed
    assert set(coverage(lora, {"transformer": made})["transformer"].values()) == {"ok"}  # `lora inspect --engine`
    # Qwen-Image's last block's text stream feeds no output: no engine holds it (diffusers' fused model ignores it)
    assert len(made.unread) == (3 if source.family() == "qwenimage" else 0)


def test_a_lora_module_of_another_shape_on_an_unread_weight_is_refused(qwen, tmp_path):
    """Qwen-Image's last to_add_out feeds no output, yet a ΔW of another shape on it is from another network: refused
    as one on a read weight is, by the engine and by `lora inspect --engine`, the engine's LoRAs as they were."""
    source, _, engine = qwen
    module = f"transformer_blocks.{source.component_config('transformer')['num_layers'] - 1}.attn.to_add_out"
    made = engine.transformer.loras.weight_map()
    assert made.unread[f"{module}.weight"] == (32, 32)
    wide = lora_file(tmp_path / "wide.safetensors", f"transformer.{module}", 32, 64)
    refusal = rf"'{re.escape(module)}' changes a \[64, 32\] weight, this transformer's is \[32, 32\]"
    assert re.search(refusal, coverage(read_lora(wide, "qwenimage"), {"transformer": made})["transformer"][module])
    with pytest.raises(LoraError, match=refusal):
        engine.load_lora_weights(wide, adapter_name="wide")
    assert engine.get_active_adapters() == []


def test_a_lora_of_another_family_is_refused_before_any_work(family, tmp_path):
    """A FLUX.1 LoRA on the engine pipeline: one line, the engine's LoRAs as they were; through the CLI, a Qwen-Image
    LoRA on Z-Image: exit 2 before the pipeline loads."""
    source, _, engine, _, _ = family
    flux1 = lora_file(tmp_path / "flux1.safetensors", "transformer.single_transformer_blocks.0.proj_mlp", 32, 128)
    active = engine.transformer.loras.active
    label = LABELS[source.family()]
    with pytest.raises(LoraFamilyError, match=rf"^[^\n]* is a FLUX.1 LoRA .*takes {label} LoRAs$"):
        engine.load_lora_weights(flux1, adapter_name="other")
    assert engine.transformer.loras.active == active and engine.get_active_adapters() == []
    if source.family() != "zimage":
        return  # one CLI run (5 s) proves the CLI's refusal: a Qwen-Image LoRA on Z-Image, told by its names
    qwen_lora = lora_file(tmp_path / "qwen.safetensors", "transformer.transformer_blocks.0.img_mlp.net.2", 64, 32)
    result = run_cli("generate", "--model", "tiny-zimage", "--prompt", "a fox", "--lora", f"{qwen_lora}:0.5")
    assert result.returncode == 2 and "Loading pipeline" not in result.stderr
    assert "is a Qwen-Image LoRA" in result.stderr and "takes Z-Image LoRAs" in result.stderr


def attention_lora(path, network, blocks: tuple[int, ...]) -> str:
    """A rank-1 LoRA on every attention Linear of ``network``'s joint ``blocks``, under diffusers' own module names
    (the network built on the meta device from its published config), as diffusers' PEFT files name them."""
    from safetensors.torch import save_file

    linears = [(n, m) for n, m in network.named_modules() if isinstance(m, torch.nn.Linear) and ".attn." in n]
    save_file({f"transformer.{n}.lora_{ab}.weight": torch.ones(*shape) for n, m in linears
               if n.startswith("transformer_blocks.") and int(n.split(".")[1]) in blocks
               for ab, shape in (("A", (1, m.in_features)), ("B", (m.out_features, 1)))}, str(path))  # fmt: skip
    return str(path)


def test_an_attention_only_lora_is_told_qwen_image_from_sd3_by_width_and_depth(tmp_path):
    """SD3's, FLUX.1's and Qwen-Image's joint attention have the same diffusers names: read without a model, a
    Qwen-Image LoRA on its attention is Qwen-Image's (3072 wide, a block past FLUX.1's 19), not SD3's, and refused on
    an SD3 model; SD3 Medium's (1536 wide) is SD3's and refused on Qwen-Image; FLUX.1's (3072, blocks 0-18) is taken
    by FLUX.1 and Qwen-Image alike; a tiny model's width says nothing (read as before)."""
    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
    )

    from sdtrt.lora.files import check_family

    with torch.device("meta"):
        qwen_image, flux = QwenImageTransformer2DModel(), FluxTransformer2DModel()  # their defaults: the published
        sd3 = SD3Transformer2DModel(num_layers=24, num_attention_heads=24, caption_projection_dim=1536)  # SD3 Medium
    qwen_lora = attention_lora(tmp_path / "qwen.safetensors", qwen_image, (0, 59))
    sd3_lora = attention_lora(tmp_path / "sd3.safetensors", sd3, (0, 23))
    flux_lora = attention_lora(tmp_path / "flux.safetensors", flux, (0, 18))
    tiny = lora_file(tmp_path / "tiny.safetensors", "transformer.transformer_blocks.1.attn.to_add_out", 32, 32)

    assert read_lora(qwen_lora).family == "Qwen-Image" and len(read_lora(qwen_lora).parts["transformer"]) == 16
    with pytest.raises(LoraFamilyError, match=r"is a Qwen-Image LoRA \('.*joint block 59 of a 3072-wide .*takes SD3"):
        check_family(qwen_lora, "sd3")
    assert read_lora(sd3_lora).family == "SD3"
    with pytest.raises(LoraFamilyError, match=r"is a SD3 LoRA \('.*: 1536 input features'\).*takes Qwen-Image"):
        check_family(sd3_lora, "qwenimage")
    assert read_lora(flux_lora).family == "FLUX.1"
    assert check_family(flux_lora, "flux") is None and check_family(flux_lora, "qwenimage") is None
    assert read_lora(tiny).family == "SD3"
    with torch.device("meta"):  # FLUX.2 [dev]'s published width (48 heads of 128), its attention named as SD3's
        dev = Flux2Transformer2DModel(num_layers=1, num_single_layers=1)
    dev_lora = attention_lora(tmp_path / "dev.safetensors", dev, (0,))
    assert read_lora(dev_lora).family == "FLUX.2"
