"""PEFT's ``add_adapter(LoraConfig)`` on engine stand-ins (issue 37): the same LoRA weights as PyTorch's PEFT makes from
the same seed, registered as an adapter of diffusers' LoRA API on engines; what an engine cannot hold is refused in
one line. Tiny SD 1.x fp32 engine set, ONNX Runtime on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from sdtrt.core.errors import LoraError
from sdtrt.pipeline.loading import load_pipeline, set_loras
from sdtrt.standins.adapter_files import ADDED, OWN_FILES
from sdtrt.tools.image_quality import psnr_db

from .helpers import peft_lora

TEXT = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"], init_lora_weights=False)
UNET = LoraConfig(r=4, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False)


@pytest.fixture(scope="module")
def engines(tiny, fp32_engine_sets):
    return load_pipeline(tiny, fp32_engine_sets("tiny"))


@pytest.fixture
def fresh(engines):
    set_loras(engines, [])  # forgets the adapters too
    return engines


def image(pipe) -> np.ndarray:
    generator = torch.Generator().manual_seed(0)
    return pipe("a lighthouse", num_inference_steps=3, generator=generator, output_type="np").images[0]


def add(pipe, name: str, seed: int, networks=("text_encoder", "unet")) -> None:
    torch.manual_seed(seed)
    for network in networks:
        getattr(pipe, network).add_adapter(TEXT if network == "text_encoder" else UNET, adapter_name=name)


def test_add_adapter_makes_peft_s_weights_and_the_adapter_api_drives_them(tiny, fresh, tmp_path):
    from diffusers import StableDiffusionPipeline

    base, reference = image(fresh), load_pipeline(tiny)
    for pipe in (fresh, reference):
        add(pipe, "x", seed=7)
    added = image(fresh)
    assert psnr_db(added, image(reference)) >= 35 and psnr_db(added, base) < 30
    assert fresh.get_list_adapters() == reference.get_list_adapters() and fresh.unet.peft_config["x"].r == 4
    # the same weights, bit for bit, as PyTorch's PEFT adapter saved by diffusers and loaded with load_lora_weights
    layers = {
        f"{c}_lora_layers": get_peft_model_state_dict(getattr(reference, c), adapter_name="x")
        for c in ("unet", "text_encoder")
    }
    metadata = {
        f"{c}_lora_adapter_metadata": config.to_dict() for c, config in (("unet", UNET), ("text_encoder", TEXT))
    }
    StableDiffusionPipeline.save_lora_weights(tmp_path, **layers, **metadata)
    fresh.load_lora_weights(tmp_path, adapter_name="saved")
    assert np.array_equal(image(fresh), added)
    for pipe in (fresh, reference):  # a second adapter, both at weights (a negative one too), fused, unloaded
        add(pipe, "y", seed=8, networks=("unet",))
        pipe.set_adapters(["x", "y"], [0.8, -0.5])
    own_files = fresh.unet.__dict__[OWN_FILES]  # x's and y's: x's second add_adapter replaced its first file
    assert len(list(own_files.iterdir())) == 2
    assert psnr_db(image(fresh), image(reference)) >= 35
    for pipe in (fresh, reference):  # an inactive adapter named fuses too, at the weight it keeps (-0.5), as in PEFT
        pipe.set_adapters("x")
        pipe.fuse_lora(components=["unet", "text_encoder"], adapter_names=["x", "y"])
    assert fresh.num_fused_loras == reference.num_fused_loras == 2
    assert psnr_db(image(fresh), image(reference)) >= 35
    fresh.unfuse_lora()
    fresh.unload_lora_weights()
    assert fresh.unet.peft_config is None and np.array_equal(image(fresh), base)
    assert not list(own_files.iterdir()) and not fresh.unet.__dict__[ADDED]  # no adapter left to read them


def test_add_adapter_activates_the_new_adapter_on_its_network_only(tiny, fresh):
    """PEFT's set_adapter is per network: the text encoder keeps running its adapter when the UNet gets another."""
    reference = load_pipeline(tiny)
    for pipe in (fresh, reference):
        add(pipe, "a", seed=1, networks=("text_encoder",))
        add(pipe, "b", seed=2, networks=("unet",))
    assert psnr_db(image(fresh), image(reference)) >= 35


def test_a_text_encoder_adapter_on_its_feed_forward_only(tiny, fresh):
    """No attention layer among its targets, which diffusers' key converters need to tell PEFT's names."""
    reference = load_pipeline(tiny)
    for pipe in (fresh, reference):
        torch.manual_seed(5)
        pipe.text_encoder.add_adapter(LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False), "ff")
    assert psnr_db(image(fresh), image(reference)) >= 35


def test_what_an_engine_cannot_hold_is_refused_in_one_line(tiny, fresh, tmp_path):
    fresh.load_lora_weights(peft_lora(tiny, tmp_path, seed=1, rank=4, alpha=4), adapter_name="loaded")
    add(fresh, "x", seed=3, networks=("unet",))
    before = [n.active for n in (fresh.unet.loras, fresh.text_encoder.loras)]
    cases = [
        (LoraConfig(r=4, target_modules=["to_q"], use_dora=True), "x2", "use_dora asks for a LoRA variant, DoRA"),
        (LoraConfig(r=4, target_modules=["to_q"], alora_invocation_tokens=[1]), "x2", "variant, aLoRA"),
        (LoraConfig(r=4, target_modules=["to_q"], init_lora_weights="mica"), "x2", "'mica' asks for a LoRA variant"),
        (LoraConfig(r=4, target_modules=["to_q"], lora_bias=True), "x2", "lora_bias asks for a LoRA bias"),
        (LoraConfig(r=4, target_modules=["to_q"], init_lora_weights="pissa"), "x2", "starts from the base weights"),
        (LoraConfig(r=4, target_modules=["not_there"]), "x2", r"Target modules \{'not_there'\} not found"),
        (UNET, "x", "adapter 'x' already exists in the unet"),
        (UNET, "loaded", "'loaded' is in use"),
        ({"r": 4}, "x2", "takes a peft LoraConfig, not a dict"),
    ]
    for config, name, message in cases:
        with pytest.raises(LoraError, match=message) as refused:
            fresh.unet.add_adapter(config, adapter_name=name)
        assert "\n" not in str(refused.value)
    assert "load_lora_weights" in str(refused.value)
    assert [n.active for n in (fresh.unet.loras, fresh.text_encoder.loras)] == before


def test_add_adapter_on_a_flux_transformer_matches_peft_on_pytorch(fp32_engine_sets):
    """The transformer stand-in and Flux's CLIP, at a negative weight."""
    from sdtrt.sources.models import resolve_model

    flux = resolve_model("tiny-flux")
    engines, reference = load_pipeline(flux, fp32_engine_sets("tiny-flux")), load_pipeline(flux)
    transformer = LoraConfig(r=4, target_modules=["to_q", "to_v", "proj_mlp", "proj_out"], init_lora_weights=False)

    def run(pipe):
        generator = torch.Generator().manual_seed(0)
        call = dict(num_inference_steps=2, height=128, width=128, generator=generator, output_type="np")
        return pipe("a fox", **call).images[0]

    for pipe in (engines, reference):
        torch.manual_seed(7)
        pipe.text_encoder.add_adapter(TEXT, adapter_name="x")
        pipe.transformer.add_adapter(transformer, adapter_name="x")
        pipe.set_adapters("x", -0.7)
    assert psnr_db(run(engines), run(reference)) >= 35


def test_alpha_patterns_are_peft_s_regular_expressions(tiny, tmp_path):
    """Each module's scale read from a file's alpha_pattern is the scaling PEFT gave that layer (peft matches a pattern
    as a regular expression on the end of a module's name)."""
    from diffusers import StableDiffusionPipeline

    from sdtrt.lora.files import read_lora
    from sdtrt.sources.models import load_folder

    patterns = {
        "unet": {r"down_blocks\.\d\.attentions\.\d\.transformer_blocks\.0\.attn1\.to_[qk]": 16, "to_out.0": 6},
        "text_encoder": {r"layers\.0\.self_attn\.(q|v)_proj": 12},
    }
    layers, scalings = {}, {}
    for network, config in (("unet", UNET), ("text_encoder", TEXT)):
        module = load_folder(tiny, network)
        module.add_adapter(LoraConfig(**{**config.to_dict(), "alpha_pattern": patterns[network]}))
        layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
        layers[f"{network}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
        scalings[network] = {name.removeprefix("text_model."): layer.scaling["default"]
                             for name, layer in module.named_modules() if hasattr(layer, "scaling")}  # fmt: skip
    StableDiffusionPipeline.save_lora_weights(tmp_path, **layers)
    read = read_lora(tmp_path / "pytorch_lora_weights.safetensors")
    for network, scaling in scalings.items():
        assert {m: pair.scale for m, pair in read.parts[network].items()} == scaling
    assert len(set(scalings["unet"].values())) == 3 and len(set(scalings["text_encoder"].values())) == 2


def test_an_orthogonal_init_draws_what_peft_draws_on_pytorch(tiny, engines):
    from sdtrt.sources.models import load_folder
    from sdtrt.standins.peft_adapters import peft_state_dict

    config = LoraConfig(r=4, target_modules=["to_q", "to_v"], init_lora_weights="orthogonal")
    torch.manual_seed(3)
    drawn = peft_state_dict(engines.unet, config, "o", "add_adapter")
    torch.manual_seed(3)
    unet = load_folder(tiny, "unet")
    unet.add_adapter(config, adapter_name="o")
    reference = get_peft_model_state_dict(unet, adapter_name="o")
    assert drawn.keys() == reference.keys() and all(torch.equal(drawn[k], reference[k]) for k in drawn)


def test_a_denoiser_only_hotswap_keeps_the_adapters_text_encoder_part(tiny, fresh, tmp_path):
    """diffusers hotswaps the networks the file has: the text encoder keeps the adapter's part, at its weight."""
    from diffusers import StableDiffusionPipeline

    from sdtrt.sources.models import load_folder

    torch.manual_seed(9)
    unet = load_folder(tiny, "unet")
    unet.add_adapter(UNET)
    unet_only = {"unet_lora_layers": get_peft_model_state_dict(unet), "unet_lora_adapter_metadata": UNET.to_dict()}
    StableDiffusionPipeline.save_lora_weights(tmp_path, **unet_only)
    reference = load_pipeline(tiny)
    for pipe in (fresh, reference):
        add(pipe, "x", seed=7)
        pipe.set_adapters("x", 0.6)
        pipe.load_lora_weights(tmp_path, adapter_name="x", hotswap=True)
    assert fresh.get_list_adapters() == reference.get_list_adapters() == {"unet": ["x"], "text_encoder": ["x"]}
    assert psnr_db(image(fresh), image(reference)) >= 35


def test_a_stand_in_taken_out_of_its_newest_pipeline_keeps_its_older_one(tiny, fresh):
    from sdtrt.sources.models import load_folder

    other = type(fresh)(**fresh.components)  # the newest pipeline the UNet stand-in is in, until it is swapped out
    other.register_modules(unet=load_folder(tiny, "unet"))
    add(fresh, "x", seed=3, networks=("unet",))
    assert list(fresh.unet.peft_config) == ["x"] and fresh.get_active_adapters() == ["x"]
