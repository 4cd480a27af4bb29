"""LoRAs on the ONNX Runtime engine without a rebuild, checked against diffusers' own fused PyTorch UNet.

The LoRA files are made here with random weights: two in diffusers/PEFT format (PEFT's LoraConfig on
the tiny UNet, saved by diffusers) and one kohya/A1111 file written key by key.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from sdtrt.core.artifact import Artifact
from sdtrt.core.errors import LoraError, RefitError
from sdtrt.graph.graph_weights import read_initializers
from sdtrt.lora.files import parse_lora_option
from sdtrt.lora.refit import EngineLoras, apply_loras
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline, set_loras
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.stages import weight_map
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db

from .helpers import last_line, peft_lora, run_cli

REQUEST = GenerateRequest(prompt="a lighthouse at dusk", steps=4, seed=3)
TO_Q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


KOHYA = {  # network → key prefix, module names a kohya trainer targets (attention projections)
    "unet": ("lora_unet_", ("to_q", "to_v", "proj_in")),
    "text_encoder": ("lora_te_text_model_", ("q_proj", "k_proj", "v_proj", "out_proj")),
}


def kohya_key(network: str, module: str) -> str:
    return KOHYA[network][0] + module.removeprefix("text_model.").replace(".", "_")


def kohya_lora(model, path, network: str = "unet", alphas: tuple[float, ...] = (8.0, 4.0)) -> str:
    """kohya/A1111 naming (lora_unet_… / lora_te_text_model_…, lora_down/lora_up, a per-module alpha), as
    its trainers write it: attention projections only, rank 8, the alphas taken in turn module by module."""
    from safetensors.torch import save_file

    leaves = KOHYA[network][1]
    generator = torch.Generator().manual_seed(7)
    modules = [
        (name, module)
        for name, module in load_folder(model, network).named_modules()
        if name.split(".")[-1] in leaves and (network != "unet" or "attentions" in name)
    ]
    tensors = {}
    for index, (name, module) in enumerate(modules):
        weight, key = module.weight, kohya_key(network, name)
        tensors[f"{key}.lora_down.weight"] = torch.randn(8, *weight.shape[1:], generator=generator) * 0.3
        tensors[f"{key}.lora_up.weight"] = torch.randn(weight.shape[0], 8, *([1, 1] if weight.ndim == 4 else []),
                                                       generator=generator) * 0.3  # fmt: skip
        tensors[f"{key}.alpha"] = torch.tensor(alphas[index % len(alphas)])
    save_file(tensors, str(path))
    return str(path)


def merge_kohya_by_hand(pipe, path: str, network: str) -> None:
    """W += (alpha/rank)·up·down for every module of a kohya file, straight from its tensors."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    with torch.no_grad():
        for name, module in getattr(pipe, network).named_modules():
            if (key := kohya_key(network, name)) + ".alpha" in tensors:
                down, up = tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"]
                delta = up.flatten(1) @ down.flatten(1) * (float(tensors[f"{key}.alpha"]) / down.shape[0])
                module.weight += delta.reshape(module.weight.shape)


@pytest.fixture(scope="module")
def loras(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("loras")
    return {
        "a": peft_lora(tiny, folder / "a", seed=1, rank=4, alpha=8),
        "b": peft_lora(tiny, folder / "b", seed=2, rank=2, alpha=1),
        "kohya": kohya_lora(tiny, folder / "kohya.safetensors"),
        "text": peft_lora(tiny, folder / "text", seed=3, rank=4, alpha=4, networks=("text_encoder",)),
        "both": peft_lora(tiny, folder / "both", seed=4, rank=4, alpha=8, networks=("unet", "text_encoder")),
        "kohya_text": kohya_lora(tiny, folder / "kohya_text.safetensors", "text_encoder", alphas=(4.0,)),
        "kohya_text_alphas": kohya_lora(tiny, folder / "kohya_text_alphas.safetensors", "text_encoder"),
        "folder": folder,
    }


@pytest.fixture(scope="module")
def engine_pipe(tiny, tiny_engine):
    return load_pipeline(tiny, tiny_engine)


def image(pipe) -> np.ndarray:
    return np.asarray(generate(pipe, REQUEST).images[0], dtype=np.float64) / 255


def test_weight_map_places_every_lora_weight_by_value(tiny, tiny_engine):
    made = weight_map.for_engine(tiny_engine, tiny)
    assert made.unmapped == {}
    assert len(made.mapped) == len(weight_map.lora_parameters(load_folder(tiny, "unet")))
    place = made.mapped[f"{TO_Q}.weight"]
    assert place.transpose and place.shape == (32, 32)  # a Linear weight: MatMul's B, transposed
    value = read_initializers(made.graph, {place.initializer})[place.initializer]
    expected = dict(load_folder(tiny, "unet", torch.float16).named_parameters())[f"{TO_Q}.weight"]
    assert np.array_equal(value, expected.detach().T.numpy())
    again = weight_map.for_engine(tiny_engine, tiny)  # one map per graph: a cache hit
    assert again == made


def test_loras_match_diffusers_fused_pytorch(tiny, loras, engine_pipe):
    engine_pipe.unet.clear_loras()
    base = image(engine_pipe)
    for case in ([(loras["a"], 0.8)], [(loras["a"], 0.8), (loras["b"], 0.5)], [(loras["kohya"], 1.0)]):
        engine_pipe.unet.set_loras(case)
        got = image(engine_pipe)
        reference = image(load_pipeline(tiny, loras=case))  # diffusers: load_lora_weights + fuse_lora(lora_scale=…)
        assert psnr_db(got, reference) >= 35, case
        assert psnr_db(got, base) < 30, case  # the LoRA changes the image: the comparison means something


def test_switching_starts_from_the_base_weights(loras, engine_pipe):
    engine_pipe.unet.clear_loras()
    base = image(engine_pipe)
    engine_pipe.unet.set_loras([(loras["a"], 0.8)])
    with_a = image(engine_pipe)
    engine_pipe.unet.set_loras([(loras["b"], 1.0)])
    with_b = image(engine_pipe)
    engine_pipe.unet.set_loras([(loras["a"], 0.8)])
    assert np.array_equal(image(engine_pipe), with_a)  # A → B → A: A, not a blend
    assert not np.array_equal(with_a, with_b)
    engine_pipe.unet.clear_loras()
    assert np.array_equal(image(engine_pipe), base)
    assert engine_pipe.unet.loras.active == [] and engine_pipe.unet.loras.last_swap_s < 30


@pytest.fixture(scope="module")
def set_pipe(tiny, tiny_set):
    return load_pipeline(tiny, tiny_set)


def test_text_encoder_loras_on_an_engine_set_match_diffusers(tiny, loras, set_pipe):
    set_loras(set_pipe, [])
    base = image(set_pipe)
    for case in ([(loras["text"], 0.8)], [(loras["both"], 1.0), (loras["b"], 0.5)], [(loras["kohya_text"], 1.0)]):
        set_loras(set_pipe, case)
        got = image(set_pipe)
        assert psnr_db(got, image(load_pipeline(tiny, loras=case))) >= 35, case
        assert psnr_db(got, base) < 30, case
    mapped = set_pipe.text_encoder.loras._map_or_make()
    assert mapped.unmapped == {} and mapped.mapped["encoder.layers.0.self_attn.k_proj.weight"].columns is not None
    set_loras(set_pipe, [(loras["text"], 0.8)])
    with_text = image(set_pipe)
    set_loras(set_pipe, [(loras["both"], 1.0)])
    set_loras(set_pipe, [(loras["text"], 0.8)])
    assert np.array_equal(image(set_pipe), with_text)  # A → B → A on both networks
    set_loras(set_pipe, [])
    assert np.array_equal(image(set_pipe), base)
    assert set_pipe.text_encoder.loras.active == [] == set_pipe.unet.loras.active


def test_kohya_alphas_count_per_text_encoder_module(tiny, loras, set_pipe):
    """Each module's own alpha/rank. The reference is merged by hand: diffusers 0.42.1 gives every text
    encoder module the most common alpha (utils/peft_utils.py get_peft_kwargs keys the text encoder's
    alpha_pattern by the attention block, "…self_attn", which matches no projection)."""
    set_loras(set_pipe, [(loras["kohya_text_alphas"], 1.0)])
    reference = load_pipeline(tiny)
    merge_kohya_by_hand(reference, loras["kohya_text_alphas"], "text_encoder")
    assert psnr_db(image(set_pipe), image(reference)) >= 35
    set_loras(set_pipe, [])


def test_a_text_encoder_lora_needs_the_text_encoder_on_an_engine(tiny, tiny_set, loras, set_pipe, engine_pipe):
    fresh = load_pipeline(tiny, tiny_set, loras=[(loras["a"], 0.8)])  # a UNet-only LoRA on a whole set
    assert fresh.unet.loras._map is not None and fresh.text_encoder.loras._map is None  # no text encoder map made
    set_loras(set_pipe, [(loras["a"], 0.8)])
    before = [image(pipe) for pipe in (set_pipe, engine_pipe)]
    with pytest.raises(LoraError, match=r"changes the text encoder \(text_encoder\) too: .* sdtrt.set_loras"):
        set_pipe.unet.set_loras([(loras["both"], 1.0)])
    with pytest.raises(LoraError, match=r"changes the text encoder \(text_encoder\), which runs on PyTorch in this"):
        set_loras(engine_pipe, [(loras["text"], 1.0)])  # a UNet engine: the text encoder is PyTorch's
    after = [image(pipe) for pipe in (set_pipe, engine_pipe)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))  # refused: nothing changed


def test_sdxl_loras_change_the_unet_and_both_text_encoders(store, tmp_path):
    model = resolve_model("tiny-sdxl")
    lora = peft_lora(model, tmp_path, seed=5, rank=4, alpha=4, networks=("unet", "text_encoder", "text_encoder_2"))
    pipe = load_pipeline(model, compile_model(model, store, "onnxruntime").final, loras=[(lora, 0.8)])
    request = GenerateRequest(prompt="a lighthouse at dusk", steps=4, seed=3, height=128, width=128)
    got = np.asarray(generate(pipe, request).images[0], dtype=np.float64) / 255
    reference = np.asarray(generate(load_pipeline(model, loras=[(lora, 0.8)]), request).images[0], dtype=np.float64)
    assert psnr_db(got, reference / 255) >= 35
    assert all(
        network.loras.active == [(Path(lora), 0.8)] for network in (pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
    )


def foreign_lora(path, module: str, shape_in: int) -> str:
    from safetensors.torch import save_file

    save_file(
        {f"unet.{module}.lora_A.weight": torch.ones(4, shape_in), f"unet.{module}.lora_B.weight": torch.ones(32, 4)},
        str(path),
    )
    return str(path)


def test_bad_input_is_one_line_and_the_engine_keeps_its_weights(loras, engine_pipe):
    folder = loras["folder"]
    engine_pipe.unet.set_loras([(loras["a"], 0.8)])
    with_a = image(engine_pipe)
    truncated = folder / "truncated.safetensors"
    truncated.write_bytes(Path(loras["a"]).read_bytes()[:500])
    text = folder / "notes.safetensors"
    text.write_text("not a tensor file\n")
    sdxl_like = "down_blocks.2.attentions.1.transformer_blocks.9.attn1.to_q"  # SDXL has 10 blocks there; tiny 1
    cases = [
        ([(foreign_lora(folder / "wide.safetensors", TO_Q, 640), 1.0)], "another architecture"),
        ([(foreign_lora(folder / "sdxl.safetensors", sdxl_like, 32), 1.0)], f"'{sdxl_like}' is not in this UNet"),
        ([(str(truncated), 1.0)], "not a readable safetensors file"),
        ([(str(text), 1.0)], "not a readable safetensors file"),
        ([(loras["b"], 0.5), (loras["a"], math.inf)], "must be a finite number"),
        ([(loras["a"], math.nan)], "must be a finite number"),
        ([(str(folder / "missing.safetensors"), 1.0)], "does not exist"),
        ([(str(folder), 1.0)], "is a folder without pytorch_lora_weights.safetensors"),
        ([loras["a"]], r"LoRAs are \(file, scale\) pairs"),
        ([(loras["a"], "0.8")], "is a str, not a number"),
    ]
    for case, message in cases:
        with pytest.raises(LoraError, match=message) as caught:
            engine_pipe.unet.set_loras(case)
        assert "\n" not in str(caught.value)
    assert np.array_equal(image(engine_pipe), with_a)
    assert engine_pipe.unet.loras.active[0][1] == 0.8
    with pytest.raises(LoraError, match="another architecture"):  # diffusers' API on engines: the same refusal
        engine_pipe.load_lora_weights(folder / "wide.safetensors")
    assert np.array_equal(image(engine_pipe), with_a) and engine_pipe.get_list_adapters() == {}
    engine_pipe.unet.set_loras([(Path(loras["a"]).parent, 0.8)])  # the folder save_lora_weights wrote
    assert np.array_equal(image(engine_pipe), with_a)


def test_lora_options_name_the_file_then_the_scale(tmp_path):
    assert parse_lora_option("style.safetensors:0.5") == ("style.safetensors", 0.5)
    assert parse_lora_option("style.safetensors") == ("style.safetensors", 1.0)
    odd = tmp_path / "v2:final.safetensors"  # a colon in an existing file's name is part of it
    odd.write_bytes(b"")
    assert parse_lora_option(str(odd)) == (str(odd), 1.0)
    for bad in ("style.safetensors:abc", "style.safetensors:", "style.safetensors:0,8"):
        with pytest.raises(LoraError, match="is not a scale; write FILE\\[:SCALE\\]"):
            parse_lora_option(bad)


def test_a_weight_the_map_cannot_place_is_refused_by_name(tiny, tiny_engine, loras, tmp_path):
    """A graph whose to_q weight was changed (as a fold into another constant would) has it unmapped."""
    graph = onnx.load(str(tiny_engine.primary))
    place = weight_map.for_engine(tiny_engine, tiny).mapped[f"{TO_Q}.weight"]
    init = next(i for i in graph.graph.initializer if i.name == place.initializer)
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 2, init.name))
    onnx.save(graph, str(tmp_path / "unet.onnx"))
    shutil.copy(tiny_engine.path / "manifest.json", tmp_path / "manifest.json")
    made = weight_map.build(tmp_path / "unet.onnx", tiny)
    assert list(made.unmapped) == [f"{TO_Q}.weight"]
    runtime = open_runtime(Artifact(tmp_path, {**tiny_engine.manifest, "primary": "unet.onnx", "files": []}), tiny)
    with pytest.raises(LoraError, match=f"cannot place {TO_Q}.weight: no initializer holds its value"):
        apply_loras([EngineLoras("unet", runtime, lambda: made)], [(loras["a"], 1.0)], lambda _: "")


class RefusingRuntime:
    """An engine runtime that cannot take new weights, as TensorRT without --refittable (it refuses up front)
    or with a refit that fails midway (refit_cuda_engine returned False: some weights may have changed)."""

    def __init__(self, error: LoraError) -> None:
        self.error, self.calls = error, 0

    def set_weights(self, weights) -> None:
        self.calls += 1
        raise self.error


@pytest.mark.parametrize(("error", "rewrites"), [(LoraError("built without --refittable"), 0),
                                                 (RefitError("refit_cuda_engine returned False"), 1)])  # fmt: skip
def test_clearing_after_a_refused_swap_rewrites_only_what_may_have_changed(tiny, tiny_engine, loras, error, rewrites):
    runtime = RefusingRuntime(error)
    target = EngineLoras("unet", runtime, lambda: weight_map.for_engine(tiny_engine, tiny))
    with pytest.raises(type(error)):
        apply_loras([target], [(loras["a"], 1.0)], lambda _: "")
    if rewrites:  # weights that may have changed are rewritten from base, which this runtime refuses again
        with pytest.raises(RefitError):
            apply_loras([target], [], lambda _: "")
    else:  # nothing changed: back to base is a no-op
        apply_loras([target], [], lambda _: "")
    assert runtime.calls == 1 + rewrites and target.active == []


def test_cli_inspect_and_generate_with_loras(tiny_engine, tiny_set, loras, tmp_path):
    inspected = run_cli("lora", "inspect", loras["a"], "--engine", str(tiny_engine.path), check=True)
    assert "format: diffusers (PEFT)" in inspected.stdout and "ranks: [4]" in inspected.stdout
    assert "scales: [2.0]" in inspected.stdout and "engine: covers 48/48 modules" in inspected.stdout
    both = run_cli("lora", "inspect", loras["both"], "--engine", str(tiny_set.path), check=True)
    assert "networks: unet (48 modules), text_encoder (12 modules)" in both.stdout
    assert "engine: covers 60/60 modules" in both.stdout
    unet_only = run_cli("lora", "inspect", loras["both"], "--engine", str(tiny_engine.path))
    assert unet_only.returncode == 1 and "first 'text_encoder: encoder.layers.0" in unet_only.stderr
    assert "no text encoder engine given" in unet_only.stderr
    kohya = run_cli("lora", "inspect", loras["kohya"], check=True)
    assert "format: kohya" in kohya.stdout and "scales: [0.5, 1.0]" in kohya.stdout
    out = tmp_path / "fox.png"
    args = ["generate", "--engine", str(tiny_engine.path), "--steps", "2", "--out", str(out)]
    made = run_cli(*args, "--lora", f"{loras['a']}:0.8", "--lora", loras["b"], check=True)
    assert last_line(made.stdout) == str(out) and out.is_file()
    refused = run_cli(*args, "--lora", f"{loras['a']}:inf")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "must be a finite number" in refused.stderr


def test_a_wrong_architecture_lora_on_pytorch_is_refused_in_one_line(tiny, loras, tmp_path):
    wide = foreign_lora(loras["folder"] / "wide.safetensors", TO_Q, 640)
    with pytest.raises(LoraError, match=f"'{TO_Q}' changes a \\[32, 640\\] weight, this UNet's is .* architecture"):
        load_pipeline(tiny, loras=[(wide, 1.0)])  # checked before diffusers' load_lora_weights dumps sizes
    refused = run_cli("generate", "--steps", "1", "--out", str(tmp_path / "x.png"), "--lora", wide)
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "another architecture" in refused.stderr and "unexpected" not in refused.stderr


def test_inspect_against_a_text_encoder_engine_maps_only_the_text_encoder(tiny_set, loras, store):
    text_encoder = Artifact.open(tiny_set.path.parents[1] / tiny_set.manifest["members"]["text_encoder"]["stage"]
                                 / tiny_set.manifest["members"]["text_encoder"]["key"][:16])  # fmt: skip
    unet_lora = run_cli("lora", "inspect", loras["a"], "--engine", str(text_encoder.path))
    assert unet_lora.returncode == 1 and "engine: covers 0/48 modules" in unet_lora.stdout
    assert "no UNet engine given" in unet_lora.stderr, unet_lora.stderr
    text_lora = run_cli("lora", "inspect", loras["text"], "--engine", str(text_encoder.path), check=True)
    assert "engine: covers 12/12 modules" in text_lora.stdout
    maps = [a for a in store.artifacts() if a.stage == "weight-map" and a.manifest["inputs"][0]["path"] ==
            str(text_encoder.path)]  # fmt: skip
    assert len(maps) == 1, "one map, of the text encoder; none of UNet weights onto its graph"
    listed = run_cli("cache", "ls", "--engines", str(store.root), check=True).stdout.splitlines()
    row = next(line for line in listed if line.endswith(str(maps[0].path)))
    assert row.split()[2] == "text_encoder", row


def test_lora_random_makes_a_file_diffusers_and_sdtrt_read(tiny, tmp_path):
    out = tmp_path / "made" / "random.safetensors"
    made = run_cli("lora", "random", "--model", "tiny", "--out", str(out), "--rank", "4", "--text-encoders", check=True)
    assert last_line(made.stdout) == str(out) and [p.name for p in out.parent.iterdir()] == [out.name]
    inspected = run_cli("lora", "inspect", str(out), check=True)
    assert "networks: unet (" in inspected.stdout and "text_encoder (12 modules)" in inspected.stdout
    assert "ranks: [4]" in inspected.stdout and "scales: [2.0]" in inspected.stdout
    reference = load_pipeline(tiny)
    assert psnr_db(image(load_pipeline(tiny, loras=[(out, 1.0)])), image(reference)) < 40, "it changes the image"
    wrong = run_cli("lora", "random", "--out", str(tmp_path / "random.bin"))
    assert wrong.returncode == 2 and "is .safetensors" in wrong.stderr


def test_a_lora_for_a_network_the_pipeline_lacks_is_called_another_architecture(set_pipe, tmp_path):
    from sdtrt.lora.files import random_lora

    sdxl = random_lora(resolve_model("tiny-sdxl"), tmp_path / "xl.safetensors", text_encoders=True)
    with pytest.raises(LoraError, match=r"second text encoder \(text_encoder_2\), which this pipeline does not have"):
        set_loras(set_pipe, [(sdxl, 1.0)])  # tiny (SD 1.x) has no second text encoder, on PyTorch or an engine
