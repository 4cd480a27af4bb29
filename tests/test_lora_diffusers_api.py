"""diffusers' LoRA API (load_lora_weights, set_adapters, fuse_lora …) on an engine pipeline (issue 37): each call
puts the same weights into the engines as sdtrt.set_loras with the (file, scale) list it means, and the images
match diffusers' PyTorch pipeline driven by the same calls. Tiny SD 1.x engine set, ONNX Runtime on CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sdtrt.core.errors import LoraError
from sdtrt.lora.files import random_lora
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline, set_loras
from sdtrt.sources.models import resolve_model
from sdtrt.tools.image_quality import psnr_db

from .helpers import peft_lora

REQUEST = GenerateRequest(prompt="a lighthouse at dusk", steps=4, seed=3)


@pytest.fixture(scope="module")
def loras(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    return {
        "a": peft_lora(tiny, folder / "a", seed=1, rank=4, alpha=8),
        "b": peft_lora(tiny, folder / "b", seed=4, rank=4, alpha=8, networks=("unet", "text_encoder")),
    }


@pytest.fixture(scope="module")
def pipe(tiny, tiny_set):
    return load_pipeline(tiny, tiny_set)


@pytest.fixture
def fresh(pipe):
    set_loras(pipe, [])  # forgets the adapters too
    return pipe


def image(pipe) -> np.ndarray:
    return np.asarray(generate(pipe, REQUEST).images[0], dtype=np.float64) / 255


def active(pipe) -> list:
    return [(n.component, n.active) for n in (pipe.unet.loras, pipe.text_encoder.loras)]


def test_load_lora_weights_is_set_loras_bit_for_bit(fresh, loras):
    base = image(fresh)
    fresh.load_lora_weights(loras["b"], adapter_name="b")
    got, weights = image(fresh), active(fresh)
    set_loras(fresh, [(loras["b"], 1.0)])
    assert active(fresh) == weights and np.array_equal(image(fresh), got)
    assert psnr_db(got, base) < 30  # the LoRA changes the image


def test_a_state_dict_loads_as_diffusers_loads_it(tiny, fresh, loras, tmp_path):
    from safetensors.torch import load_file

    base = image(fresh)
    reference = load_pipeline(tiny)
    for target in (fresh, reference):  # no adapter metadata in memory: alpha is the rank, as diffusers takes it
        target.load_lora_weights(load_file(loras["b"]), adapter_name="dict")
    assert fresh.get_active_adapters() == ["dict"] and fresh.get_list_adapters() == reference.get_list_adapters()
    from_dict = image(fresh)
    assert psnr_db(from_dict, image(reference)) >= 35 and psnr_db(from_dict, base) < 30
    # diffusers' save_lora_weights (a classmethod over state dicts) writes what load_lora_weights reads back
    layers = {f"{c}_lora_layers": {k.removeprefix(f"{c}."): v for k, v in load_file(loras["b"]).items()
                                   if k.startswith(f"{c}.")} for c in ("unet", "text_encoder")}  # fmt: skip
    fresh.save_lora_weights(tmp_path / "saved", **layers)
    fresh.load_lora_weights(tmp_path / "saved", adapter_name="saved")
    assert np.array_equal(image(fresh), from_dict)


def test_adapters_weights_enable_and_unload(fresh, loras):
    base = image(fresh)
    fresh.load_lora_weights(loras["a"])  # a file path, default name
    fresh.load_lora_weights(str(loras["b"]).rpartition("/")[0], adapter_name="b")  # the folder
    assert fresh.get_active_adapters() == ["b"]  # diffusers: the newest adapter alone
    assert fresh.get_list_adapters() == {"unet": ["default_0", "b"], "text_encoder": ["b"]}
    fresh.set_adapters(["default_0", "b"], [0.8, 0.5])
    assert fresh.get_active_adapters() == ["default_0", "b"]
    both = image(fresh)
    weights = active(fresh)
    fresh.disable_lora()
    assert np.array_equal(image(fresh), base)
    fresh.enable_lora()
    assert active(fresh) == weights and np.array_equal(image(fresh), both)
    fresh.load_lora_weights(loras["a"], adapter_name="x")
    fresh.set_adapters(["x", "b"], [0.8, 0.5])
    fresh.delete_adapters("x")
    assert fresh.get_active_adapters() == ["b"] and fresh.get_list_adapters()["unet"] == ["default_0", "b"]
    fresh.unload_lora_weights()
    assert fresh.get_list_adapters() == {} and fresh.get_active_adapters() == []
    assert active(fresh) == [("unet", []), ("text_encoder", [])] and np.array_equal(image(fresh), base)
    set_loras(fresh, [(loras["a"], 0.8), (loras["b"], 0.5)])  # what set_adapters(["default_0", "b"], …) ran
    assert active(fresh) == weights and np.array_equal(image(fresh), both)


def test_fuse_then_unload_keeps_the_fused_weights(fresh, loras):
    fresh.load_lora_weights(loras["a"], adapter_name="a")
    fresh.set_adapters("a", 0.8)
    fresh.fuse_lora(lora_scale=0.5)
    fused = image(fresh)
    set_loras(fresh, [(loras["a"], 0.4)])
    assert np.array_equal(image(fresh), fused)
    set_loras(fresh, [])
    fresh.load_lora_weights(loras["a"], adapter_name="a")
    fresh.fuse_lora(lora_scale=0.5)
    with pytest.raises(LoraError, match=r"set_adapters on fused adapters: call unfuse_lora\(\) first"):
        fresh.set_adapters("a")
    fresh.unfuse_lora()  # PEFT keeps the scaled weight: 0.5 now, as in diffusers
    assert fresh.unet.loras.active == [(fresh.get_list_adapters() and fresh.unet.loras.active[0][0], 0.5)]
    fresh.fuse_lora()
    fresh.unload_lora_weights()  # the fused LoRA stays, as diffusers' fuse_lora + unload_lora_weights
    assert fresh.get_list_adapters() == {} and fresh.unet.loras.active[0][1] == 0.5
    fresh.load_lora_weights(loras["b"])  # on top of the fused one
    assert [s for _, s in fresh.unet.loras.active] == [0.5, 1.0]


def test_what_cannot_map_is_refused_in_one_line_and_changes_nothing(fresh, loras, tmp_path):
    fresh.load_lora_weights(loras["a"], adapter_name="a")
    before = active(fresh)
    bad = random_lora(resolve_model("tiny-sdxl"), tmp_path / "xl.safetensors", text_encoders=True)
    cases = [
        (lambda: fresh.load_lora_weights({"x": 1}), "holds 'x', a int"),
        (lambda: fresh.load_lora_weights(3), "not a int"),
        (lambda: fresh.load_lora_weights("someone/hub-lora"), "is no LoRA file on disk"),
        (lambda: fresh.load_lora_weights(loras["a"], adapter_name="a"), "'a' is already in use"),
        (lambda: fresh.load_lora_weights(bad), "text_encoder_2"),
        (lambda: fresh.set_adapters(["a"], [{"unet": {"down": 0.5}}]), "per-block weights"),
        (lambda: fresh.set_adapters(["a"], [{"transformer": 0.5}]), "no LoRA component 'transformer'"),
        (lambda: fresh.set_adapters(["nope"]), "'nope' not in the list of present adapters"),
        (lambda: fresh.set_adapters(["a"], [float("nan")]), "must be a finite number"),
        (lambda: fresh.load_lora_weights(loras["b"], adapter_name="c", hotswap=True), "'c' is none; loaded: a"),
        (lambda: fresh.load_lora_weights(loras["b"], adapter_name="a", hotswap=True), "denoiser adapters only"),
    ]
    for call, message in cases:
        with pytest.raises(LoraError, match=message) as raised:
            call()
        assert "\n" not in str(raised.value)
    assert active(fresh) == before and fresh.get_list_adapters() == {"unet": ["a"]}


def test_adapters_match_diffusers_pytorch(tiny, fresh, loras):
    reference = load_pipeline(tiny)
    for target in (fresh, reference):
        target.load_lora_weights(loras["a"], adapter_name="a")
        target.load_lora_weights(loras["b"], adapter_name="b")
        target.set_adapters(["a", "b"], [0.8, 0.5])
    assert fresh.get_list_adapters() == reference.get_list_adapters()
    assert fresh.get_active_adapters() == reference.get_active_adapters()
    assert psnr_db(image(fresh), image(reference)) >= 35
    for target in (fresh, reference):
        target.fuse_lora(lora_scale=0.7)
        target.unfuse_lora()
    assert psnr_db(image(fresh), image(reference)) >= 35
    for target in (fresh, reference):  # per-component weights: b's text encoder at 0.25, its UNet at 1.0
        target.set_adapters(["a", "b"], [0.8, {"text_encoder": 0.25}])
    assert psnr_db(image(fresh), image(reference)) >= 35


def test_a_calls_lora_scale_scales_the_adapters_as_diffusers_does(tiny, fresh, loras):
    import torch

    def run(pipe, **call):
        generator = torch.Generator().manual_seed(3)
        return pipe(REQUEST.prompt, num_inference_steps=4, generator=generator, output_type="np", **call).images[0]

    reference = load_pipeline(tiny)
    for target in (fresh, reference):
        target.load_lora_weights(loras["b"], adapter_name="b")
    full, half = run(fresh), {"cross_attention_kwargs": {"scale": 0.5}}
    halved = run(fresh, **half)
    assert psnr_db(halved, run(reference, **half)) >= 35 and psnr_db(halved, full) < 40
    assert np.array_equal(run(fresh), full)  # the next call, without a scale, runs the adapters at their weights
    again = type(fresh)(**fresh.components)  # a pipeline over the same engines shares their adapters
    assert again.get_active_adapters() == ["b"] and np.array_equal(run(again, **half), halved)
    assert np.array_equal(run(fresh), full)
    fresh.set_adapters("b", 0.5)
    assert np.array_equal(run(fresh), halved)  # a call's scale multiplies the adapters' weights


def test_a_denoiser_only_scale_is_read_from_the_pipelines_attention_kwargs():
    """SD3's inpainting passes no lora_scale to encode_prompt but gives its transformer the call's scale: as on
    PyTorch, the transformer's adapters scale and the text encoders' do not."""
    from types import SimpleNamespace

    from sdtrt.standins.adapters import call_scale_of

    sd3_inpaint = SimpleNamespace(transformer=object(), _joint_attention_kwargs={"scale": 0.5})
    assert call_scale_of(sd3_inpaint, None) == {"transformer": 0.5}
    assert call_scale_of(sd3_inpaint, 0.25) == 0.25  # given to encode_prompt: every network
    assert call_scale_of(SimpleNamespace(_cross_attention_kwargs=None), None) == 1.0
    flux2_klein = SimpleNamespace(transformer=object(), _attention_kwargs={"scale": 0.5})  # FLUX.2's name for it
    assert call_scale_of(flux2_klein, None) == {"transformer": 0.5}


def test_hotswap_replaces_an_adapters_weights_in_place(fresh, loras):
    fresh.enable_lora_hotswap(target_rank=8)  # nothing to prepare: engines are refit, at any rank
    fresh.load_lora_weights(loras["b"], adapter_name="x")
    fresh.load_lora_weights(loras["a"], adapter_name="y")
    fresh.set_adapters(["x", "y"], [0.5, 0.8])
    fresh.load_lora_weights(loras["a"], adapter_name="x", hotswap=True)  # x's place, a's weights, weight 1.0 (PEFT)
    assert fresh.get_active_adapters() == ["x", "y"] and fresh.get_list_adapters()["text_encoder"] == ["x"]
    swapped = image(fresh)
    # a has no text encoder part: x keeps b's, at its weight, as diffusers hotswaps the networks a file has
    set_loras(fresh, [(loras["a"], {"text_encoder": 0.0}), (loras["b"], {"unet": 0.0, "text_encoder": 0.5}),
                      (loras["a"], 0.8)])  # fmt: skip
    assert psnr_db(image(fresh), swapped) >= 50  # x's file holds each pair's alpha/rank folded into its up weight


def test_per_component_weights_are_set_loras_per_network_scales(fresh, loras):
    fresh.load_lora_weights(loras["b"], adapter_name="b")
    fresh.set_adapters("b", {"unet": 0.5, "text_encoder": 0.25})
    got, weights = image(fresh), active(fresh)
    assert weights == [("unet", [(Path(loras["b"]), 0.5)]), ("text_encoder", [(Path(loras["b"]), 0.25)])]
    set_loras(fresh, [(loras["b"], {"unet": 0.5, "text_encoder": 0.25})])
    assert active(fresh) == weights and np.array_equal(image(fresh), got)
    fresh.load_lora_weights(loras["a"], adapter_name="a")  # the registry takes the per-network scales as baked
    fresh.set_adapters([])
    assert active(fresh) == weights
