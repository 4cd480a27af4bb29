"""LoRAs without a rebuild on FLUX.2 [dev] (issue 38): Flux2Pipeline's transformer is klein's class at another size,
its LoRAs read by the same diffusers loader (Flux2LoraLoaderMixin.lora_state_dict, which Flux2Pipeline and
Flux2KleinPipeline share) and placed by the same weight map.

Parity with diffusers' fused LoRAs, A → B → A and the weight map are test_llm_family_lora's (its dev case); here
what is dev's own. The engine pipeline is test_flux2_dev's fp32 ONNX Runtime set (a minute to build: slow tests, a
cache hit in a run); what needs no engine (the loader, telling its LoRAs from other families') is in the default
suite.
"""

from __future__ import annotations

import pytest

from sdtrt.core.errors import LoraError, LoraFamilyError
from sdtrt.lora.files import check_family, random_lora, read_lora
from sdtrt.sources.models import load_folder

from .helpers import last_line, run_cli
from .test_flux2_dev import dev, source
from .test_new_transformer_lora import bfl_lora, lora_file

__all__ = ["dev", "source"]  # the fixtures, imported to be found here

# Modules only other families' LoRAs name: FLUX.1's single blocks' MLP, Z-Image's attention.
OTHERS = {
    "FLUX.1": ("transformer.single_transformer_blocks.0.proj_mlp", 32, 128),
    "Z-Image": ("transformer.layers.0.attention.to_q", 32, 32),
}


@pytest.fixture(scope="module")
def loras(dev, tmp_path_factory):
    """Two LoRAs on every transformer Linear of the dev preset: A diffusers/PEFT (as `sdtrt lora random` makes
    them), B kohya's BFL names (converted by diffusers' FLUX.2 loader)."""
    source, _, _ = dev
    folder = tmp_path_factory.mktemp("dev-loras")
    return {
        "a": str(random_lora(source, folder / "a.safetensors", rank=4, alpha=8, seed=1)),
        "b": bfl_lora(load_folder(source, "transformer"), folder / "b.safetensors", "kohya", seed=2),
    }


def test_dev_and_klein_read_loras_with_one_loader_and_other_families_are_refused(source, tmp_path):
    """Flux2Pipeline.lora_state_dict is the FLUX.2 kind's loader; a FLUX.1 or Z-Image LoRA on the dev model is
    refused by its names in one line, and a FLUX.1 kohya file of BFL names by its MLP width (as on klein)."""
    import diffusers

    from sdtrt.lora.kinds import LORA_FAMILIES

    loader = getattr(diffusers, LORA_FAMILIES["flux2"].loader).lora_state_dict
    assert loader.__func__ is diffusers.Flux2Pipeline.lora_state_dict.__func__
    assert source.family() == "flux2"
    for what, (module, inputs, outputs) in OTHERS.items():
        path = lora_file(tmp_path / f"{what}.safetensors", module, inputs, outputs)
        with pytest.raises(LoraFamilyError, match=rf"^[^\n]* is a {what} LoRA .*this model \(flux2\) takes FLUX.2"):
            check_family(path, source.family())
    kohya = lora_file(tmp_path / "kohya.safetensors", "lora_unet_single_blocks_0_linear1", 32, 7 * 32)
    with pytest.raises(LoraFamilyError, match=r"is a FLUX.1 LoRA \('lora_unet_single_blocks_0_linear1"):
        check_family(kohya, source.family())
    dev_kohya = lora_file(tmp_path / "dev-kohya.safetensors", "lora_unet_single_blocks_0_linear1", 32, 9 * 32)
    assert check_family(dev_kohya, source.family()) is None and read_lora(dev_kohya).family == "FLUX.2"


@pytest.mark.slow
def test_a_z_image_lora_or_one_of_another_width_is_refused_on_the_dev_engine(dev, tmp_path):
    """A LoRA of another family, or a FLUX.2 one of another width (a klein LoRA on dev: the same names, other
    shapes), is refused in one line with the engine's LoRAs as they were (a FLUX.1 one: test_llm_family_lora)."""
    _, _, engine = dev
    active = engine.transformer.loras.active
    for what, (module, inputs, outputs) in OTHERS.items():
        path = lora_file(tmp_path / f"{what}.safetensors", module, inputs, outputs)
        with pytest.raises(LoraFamilyError, match=rf"^[^\n]* is a {what} LoRA "):
            engine.load_lora_weights(path, adapter_name="other")
    wide = lora_file(tmp_path / "wide.safetensors", "transformer.transformer_blocks.0.attn.to_q", 48, 48)
    with pytest.raises(LoraError, match=r"^[^\n]*'transformer_blocks.0.attn.to_q' changes a \[48, 48\] weight"):
        engine.load_lora_weights(wide, adapter_name="other")
    assert engine.transformer.loras.active == active and engine.get_active_adapters() == []


@pytest.mark.slow
def test_cli_inspects_and_generates_with_a_dev_lora(dev, store, loras, tmp_path):
    """`sdtrt lora inspect --engine` on the dev set, `sdtrt generate --lora` on it, and a FLUX.1 LoRA refused by
    generate with exit 2 before the pipeline loads."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.tools.compile import compile_model

    engine_set = compile_model(dev[0], store, "onnxruntime", ExportConfig(precision="fp32")).final  # a cache hit
    inspected = run_cli("lora", "inspect", loras["b"], "--engine", str(engine_set.path), check=True)
    assert "format: kohya\nfamily: FLUX.2\n" in inspected.stdout and "engine: covers 17/17 modules" in inspected.stdout
    out = tmp_path / "fox.png"
    args = ["generate", "--engine", str(engine_set.path), "--steps", "2", "--out", str(out)]
    made = run_cli(*args, "--lora", f"{loras['a']}:0.8", "--lora", f"{loras['b']}:0.5", check=True)
    assert last_line(made.stdout) == str(out) and out.is_file()
    flux1 = lora_file(tmp_path / "flux1.safetensors", *OTHERS["FLUX.1"])
    refused = run_cli(*args, "--lora", flux1)
    assert refused.returncode == 2 and "Loading pipeline" not in refused.stderr
    assert "is a FLUX.1 LoRA" in refused.stderr and "takes FLUX.2 LoRAs" in refused.stderr
