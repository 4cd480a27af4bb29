"""LoRAs without a rebuild on the transformers of issue 38 (item 4): FLUX.2 [klein]'s Flux2Transformer2DModel, and
FLUX.1 Fill / Canny-Depth control / Kontext, whose x_embedder takes 384 / 128 / 64 channels.

Each engine pipeline (fp32 ONNX Runtime, the sets test_flux2_klein and test_flux_tasks build: cache hits in a run)
takes LoRAs through diffusers' LoRA API and ``set_loras``, and its images are checked against diffusers' PyTorch
pipeline with ``load_lora_weights`` + ``fuse_lora`` at >= 35 dB. The LoRAs are random, seeded and written here in the
layouts people publish: diffusers/PEFT (``random_lora``, as `sdtrt lora random` makes them), kohya's and ai-toolkit's
BFL module names (which diffusers' FLUX.2 loader converts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sdtrt.core.errors import LoraFamilyError
from sdtrt.lora.files import random_lora, read_lora
from sdtrt.pipeline.loading import generate, set_loras
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.stages import weight_map
from sdtrt.tools.image_quality import psnr_db

from .helpers import Family, run_cli
from .test_flux_tasks import TASKS, inputs

# FLUX.2 [klein]'s LoRA modules by BFL's names (what kohya's and ai-toolkit's files say) → its diffusers Linears: one
# fused q/k/v Linear in BFL's double blocks is three in diffusers'.
KLEIN_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",), "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",), "txt_mlp.2": ("ff_context.linear_out",),
}  # fmt: skip
KLEIN_SINGLE = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}
KLEIN_OUTER = {"img_in": ("x_embedder",), "txt_in": ("context_embedder",), "final_layer.linear": ("proj_out",)}


def bfl_lora(transformer, path, layout: str, seed: int, rank: int = 4, alpha: float = 8.0) -> str:
    """A random LoRA on every module of KLEIN_* by BFL's names, saved in kohya's layout (``lora_unet_…``, down/up,
    alpha) or ai-toolkit's (``diffusion_model.…``, lora_A/B): a fused Linear's LoRA is one down weight and the up
    weights of its parts stacked."""
    from safetensors.torch import save_file

    shapes = {name: tuple(m.weight.shape) for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    generator = torch.Generator().manual_seed(seed)
    modules = [(f"double_blocks.{i}.{k}", [f"transformer_blocks.{i}.{m}" for m in v])
               for i in range(transformer.config.num_layers) for k, v in KLEIN_DOUBLE.items()]  # fmt: skip
    modules += [(f"single_blocks.{i}.{k}", [f"single_transformer_blocks.{i}.{m}" for m in v])
                for i in range(transformer.config.num_single_layers) for k, v in KLEIN_SINGLE.items()]  # fmt: skip
    modules += [(k, list(v)) for k, v in KLEIN_OUTER.items()]
    tensors = {}
    for bfl, parts in modules:
        down = torch.randn(rank, shapes[parts[0]][1], generator=generator) * 0.3
        up = torch.randn(sum(shapes[p][0] for p in parts), rank, generator=generator) * 0.3
        if layout == "kohya":
            key = "lora_unet_" + bfl.replace(".", "_")
            tensors |= {f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up}
            tensors[f"{key}.alpha"] = torch.tensor(alpha)
        else:
            tensors |= {f"diffusion_model.{bfl}.lora_A.weight": down, f"diffusion_model.{bfl}.lora_B.weight": up}
    save_file(tensors, str(path))
    return str(path)


@pytest.fixture(scope="module")
def klein(store, tmp_path_factory):
    """The klein family (PyTorch and engine pipelines), its LoRAs (one per published layout), and the prompt
    embeddings both pipelines are given: the LLM encoder's (its engine's, whose parity test_flux2_klein checks; the
    PyTorch Qwen3 takes seconds a prompt, and LoRAs change the transformer alone)."""
    family = Family("tiny-flux2-klein", store, {})
    folder = tmp_path_factory.mktemp("klein-loras")
    transformer = load_folder(family.source, "transformer")
    loras = {
        "peft": str(random_lora(family.source, folder / "peft.safetensors", rank=4, alpha=8, seed=1)),
        "kohya": bfl_lora(transformer, folder / "kohya.safetensors", "kohya", seed=2),
        "ai-toolkit": bfl_lora(transformer, folder / "ai-toolkit.safetensors", "ai-toolkit", seed=3, rank=2),
    }
    _, engine = family.pipelines()
    embeds = {"prompt_embeds": engine.encode_prompt("a red fox in the snow")[0],
              "negative_prompt_embeds": engine.encode_prompt("")[0]}  # fmt: skip
    return family, loras, embeds


def klein_image(pipe, embeds, height: int = 128, width: int = 128, **call) -> np.ndarray:
    generator = torch.Generator().manual_seed(3)
    return pipe(**embeds, height=height, width=width, num_inference_steps=2, generator=generator,
                output_type="np", **call).images[0]  # fmt: skip


def image(pipe, request) -> np.ndarray:
    return generate(pipe, request, output_type="np").images[0]


def fused_reference(reference, loras: list[tuple[str, float]], run) -> np.ndarray:
    """diffusers' own: each LoRA by load_lora_weights, set_adapters at its scale, fuse_lora on the PyTorch pipeline;
    ``run(pipeline)``, then back to base."""
    names = [f"reference_{i}" for i in range(len(loras))]
    for name, (path, _) in zip(names, loras, strict=True):
        reference.load_lora_weights(path, adapter_name=name)
    reference.set_adapters(names, [scale for _, scale in loras])
    reference.fuse_lora()
    try:
        return run(reference)
    finally:
        reference.unfuse_lora()
        reference.unload_lora_weights()


def test_klein_weight_map_places_every_transformer_linear(klein):
    family, _, _ = klein
    _, engine = family.pipelines()
    made = engine.transformer.loras.weight_map()
    assert made.unmapped == {}
    assert set(made.mapped) == set(weight_map.lora_parameters(load_folder(family.source, "transformer")))


def test_klein_loras_match_diffusers_fused(klein):
    """One LoRA per layout (diffusers, kohya, ai-toolkit) at three scales, fused by diffusers in one reference."""
    family, loras, embeds = klein
    reference, engine = family.pipelines()
    layouts = ("peft", "kohya", "ai-toolkit")
    given = [(loras[layout], scale) for layout, scale in zip(layouts, (1.0, 0.6, 0.4), strict=True)]
    set_loras(engine, given)
    try:
        got = klein_image(engine, embeds)
    finally:
        set_loras(engine, [])
    want = fused_reference(reference, given, lambda pipe: klein_image(pipe, embeds))
    psnr = psnr_db(got, want)
    print(f"tiny-flux2-klein LoRA {' + '.join(layouts)} 128x128: PSNR {psnr:.1f} dB against diffusers' fused")
    # the LoRAs move the image far more than the engines differ
    assert psnr >= 35.0 and psnr_db(got, klein_image(engine, embeds)) < psnr - 20.0


def test_klein_adapters_switch_a_b_a_exactly(klein):
    family, loras, embeds = klein
    _, engine = family.pipelines()
    size = {"height": 128, "width": 192}
    set_loras(engine, [])
    base = klein_image(engine, embeds, **size)
    engine.load_lora_weights(loras["peft"], adapter_name="a")
    engine.load_lora_weights(loras["kohya"], adapter_name="b")
    engine.set_adapters(["a"], [0.8])
    with_a = klein_image(engine, embeds, **size)
    engine.set_adapters(["a", "b"], [0.8, 0.5])
    both = klein_image(engine, embeds, **size)
    engine.set_adapters(["a"], [0.8])
    assert np.array_equal(klein_image(engine, embeds, **size), with_a) and not np.array_equal(both, with_a)
    halved = klein_image(engine, embeds, **size, attention_kwargs={"scale": 0.5})  # FLUX.2's call scale
    engine.set_adapters(["a"], [0.4])
    assert np.array_equal(klein_image(engine, embeds, **size), halved) and not np.array_equal(halved, with_a)
    set_loras(engine, [(loras["peft"], 0.8)])  # what set_adapters(["a"], [0.8]) ran
    assert np.array_equal(klein_image(engine, embeds, **size), with_a)
    set_loras(engine, [])
    assert np.array_equal(klein_image(engine, embeds, **size), base)


def test_a_lora_of_another_family_is_refused_on_klein_before_any_work(klein, tmp_path):
    """A FLUX.1 LoRA (its single blocks' proj_mlp) and an SDXL one (kohya's down_blocks) on FLUX.2 [klein]: one line
    naming what the file is for, and the engine's LoRAs are as they were. The CLI refuses klein's kohya LoRA on
    FLUX.1 (BFL names both have, told apart by linear1's width) with exit 2 before loading anything."""
    family, loras, _ = klein
    _, engine = family.pipelines()
    flux1 = lora_file(tmp_path / "flux1.safetensors", "transformer.single_transformer_blocks.0.proj_mlp", 32, 128)
    sdxl_module = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q"
    sdxl = lora_file(tmp_path / "sdxl.safetensors", sdxl_module, 64, 64)
    active = engine.transformer.loras.active
    for path, what in ((flux1, "FLUX.1"), (sdxl, r"UNet \(SD 1.x/2.x, SDXL\)")):
        with pytest.raises(LoraFamilyError, match=rf"is a {what} LoRA .*this model \(flux2\) takes FLUX.2 LoRAs"):
            engine.load_lora_weights(path, adapter_name="other")
        assert engine.transformer.loras.active == active and engine.get_active_adapters() == []
    assert read_lora(loras["kohya"]).family == "FLUX.2"  # `sdtrt lora inspect` without a model
    result = run_cli("generate", "--model", "tiny-flux", "--prompt", "a fox", "--lora", f"{loras['kohya']}:0.5")
    assert result.returncode == 2 and "Loading pipeline" not in result.stderr
    assert "is a FLUX.2 LoRA ('lora_unet_single_blocks_0_linear1.lora_up.weight: 288 outputs" in result.stderr


def lora_file(path, module: str, inputs: int, outputs: int, rank: int = 2, kohya: bool = False) -> str:
    """A LoRA of one module: kohya's down/up under lora_unet_ (or where ``kohya``), else PEFT's lora_A/B."""
    from safetensors.torch import save_file

    down, up = ("lora_down", "lora_up") if kohya or module.startswith("lora_unet_") else ("lora_A", "lora_B")
    save_file({f"{module}.{down}.weight": torch.ones(rank, inputs), f"{module}.{up}.weight": torch.ones(outputs, rank)},
              str(path))  # fmt: skip
    return str(path)


@pytest.fixture(
    scope="module",
    params=["tiny-flux-fill", *(pytest.param(name, marks=pytest.mark.slow) for name in TASKS if "fill" not in name)],
)
def task(request, store):
    """Fill (the widest input) in the default suite; Control and Kontext with -m slow (11 s each)."""
    return Family(request.param, store, {})


@pytest.fixture(scope="module")
def flux1_loras(tmp_path_factory):
    """Random diffusers LoRAs on x_embedder (and every block's projections) of FLUX.1 dev (64 input channels) and
    of each task's transformer (Fill 384, Control 128, Kontext 64)."""
    folder = tmp_path_factory.mktemp("flux1-loras")
    names = ("tiny-flux", *TASKS)
    return {n: str(random_lora(resolve_model(n), folder / f"{n}.safetensors", rank=4, alpha=8, seed=i))
            for i, n in enumerate(names)}  # fmt: skip


def test_flux1_task_transformers_take_loras_on_their_input(task, flux1_loras):
    """A LoRA made on the task's transformer (its x_embedder as wide as the engine's) with a FLUX.1 dev LoRA whose
    x_embedder is narrower for Fill and Control: zero-padded, as diffusers' FLUX.1 loader pads it."""
    reference, engine = task.pipelines(TASKS[task.name])
    request = task.request(height=128, width=128, **inputs(task.name, 128, 128))
    set_loras(engine, [])
    base = image(engine, request)
    dev, own = flux1_loras["tiny-flux"], flux1_loras[task.name]
    x_embedder = {path: read_lora(path, "flux").parts["transformer"]["x_embedder"].shape for path in (dev, own)}
    assert x_embedder == {dev: (32, 64), own: (32, engine.transformer.spec.in_channels)}
    given = [(dev, 0.8), (own, 0.5)]
    set_loras(engine, given)
    got = image(engine, request)
    want = fused_reference(reference, given, lambda pipe: image(pipe, request))
    psnr = psnr_db(got, want)
    print(f"{task.name} LoRAs of FLUX.1 dev and of its own 128x128: PSNR {psnr:.1f} dB against diffusers' fused")
    assert psnr >= 35.0 and psnr_db(got, base) < psnr - 20.0
    set_loras(engine, [])  # back to base: test_klein_adapters_switch_a_b_a_exactly checks it bit for bit


def test_names_tell_flux1_from_flux2_where_they_differ():
    """FLUX.1's and FLUX.2's diffusers names differ in MLPs and single blocks; kohya's and ai-toolkit's block names are
    both families' (read as the model's); a UNet's or SD3.5's are neither."""
    from sdtrt.lora.kinds import named_kinds

    cases = {
        "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight": {"flux"},
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_A.weight": {"unet", "sd3", "flux"},
        "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight": {"flux2"},
        "transformer.transformer_blocks.0.ff_context.linear_out.lora_A.weight": {"flux2"},
        "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight": {"flux"},
        "lora_unet_single_blocks_0_linear1.lora_down.weight": {"flux", "flux2"},
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight": {"flux2"},  # FLUX.1 reads BFL names as kohya's
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": {"flux", "flux2"},
        "diffusion_model.double_stream_modulation_img.lin.lora_A.weight": {"flux2"},
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight": {"unet"},
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": None,
    }
    assert {key: named_kinds([key])[0] for key in cases} == cases


@pytest.mark.parametrize(
    ("model", "module", "inputs", "outputs", "what"),
    [
        ("tiny-flux", "lora_unet_single_blocks_0_linear1", 32, 9 * 32, "FLUX.2"),
        ("tiny-flux", "lora_unet_double_blocks_1_txt_mlp_0", 32, 6 * 32, "FLUX.2"),
        ("tiny-flux", "diffusion_model.double_blocks.0.img_attn.proj", 32, 32, "FLUX.2"),
        ("tiny-flux2-klein", "lora_unet_single_blocks_0_linear1", 3072, 7 * 3072, "FLUX.1"),
        ("tiny-flux2-klein", "lora_unet_double_blocks_0_img_mlp_0", 64, 4 * 64, "FLUX.1"),
    ],
)
def test_bfl_names_of_the_other_flux_are_refused_from_the_header(tmp_path, model, module, inputs, outputs, what):
    """kohya's BFL names are both FLUX.1's and FLUX.2's: the fused MLP input's width in the header tells them apart
    (linear1 7 or 9 x hidden, img_mlp.0 / txt_mlp.0 4 or 6 x); ai-toolkit's lora_A/B on BFL names are FLUX.2's."""
    from sdtrt.lora.files import check_family

    path = lora_file(tmp_path / "other.safetensors", module, inputs, outputs)
    with pytest.raises(LoraFamilyError, match=rf"is a {what} LoRA \('{module}"):
        check_family(path, resolve_model(model).family())
    attention = lora_file(tmp_path / "attention.safetensors", "lora_unet_double_blocks_0_img_attn_qkv", 32, 96)
    assert check_family(attention, resolve_model(model).family()) is None  # no MLP: either family's


def test_a_file_naming_both_fluxes_is_refused_as_merged(tmp_path):
    """FLUX.1's proj_mlp and FLUX.2's linear_in in one file: said so, with or without a model."""
    from safetensors.torch import save_file

    pairs = {f"transformer.{m}.lora_{ab}.weight": torch.ones(2, 2) for m in ("single_transformer_blocks.0.proj_mlp",
             "transformer_blocks.0.ff.linear_in") for ab in "AB"}  # fmt: skip
    save_file(pairs, str(tmp_path / "merged.safetensors"))
    for family in (None, "flux", "flux2"):
        with pytest.raises(LoraFamilyError, match=r"names modules of FLUX.1 \('.*proj_mlp.*'\) and of FLUX.2 .*merged"):
            read_lora(tmp_path / "merged.safetensors", family)


def test_bfl_names_with_kohyas_down_up_are_read_as_kohya(tmp_path):
    """ComfyUI's export of a kohya FLUX.1 LoRA: BFL's diffusion_model. names with down/up, converted by kohya's path."""
    path = lora_file(tmp_path / "comfy.safetensors", "diffusion_model.double_blocks.0.img_attn.qkv", 32, 96, kohya=True)
    lora = read_lora(path)
    assert (lora.format, lora.family, len(lora.parts["transformer"])) == ("kohya (BFL names)", "FLUX.1", 3)
