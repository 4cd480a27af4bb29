"""Presets written by streaming (issue 21 item 1): networks built on the meta device, their random tensors
written shard by shard in exactly the files save_pretrained writes, read back by diffusers' from_pretrained."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import resource
import signal
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdtrt.sources.preset_build import build, ensure_preset, save_streamed
from sdtrt.sources.presets import PRESETS, Recipe

SMALL_SHARDS = 20_000  # bytes: every tiny network spans several shards


def streamed(name: str, dtype: str) -> Recipe:
    return dataclasses.replace(PRESETS[name], dtype=dtype, streamed=True)


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def tensor_layout(folder: Path) -> dict[tuple[str, str], tuple[str, tuple[int, ...]]]:
    """(file, key) → (dtype, shape) of every tensor in the folder's safetensors files."""
    out = {}
    for path in folder.rglob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                view = f.get_slice(key)
                out[(str(path.relative_to(folder)), key)] = (view.get_dtype(), tuple(view.get_shape()))
    return out


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return {key: value for path in sorted(folder.glob("*.safetensors")) for key, value in load_file(path).items()}


@pytest.fixture(scope="module")
def tiny_flux_streamed(tmp_path_factory) -> Path:
    """tiny-flux in bf16 (the scale presets' dtype), written by streaming into small shards."""
    folder = tmp_path_factory.mktemp("streamed") / "tiny-flux"
    save_streamed(streamed("tiny-flux", "bfloat16"), folder, max_shard_size=SMALL_SHARDS)
    return folder


@pytest.mark.parametrize(("name", "dtype"), [("tiny-flux", "bfloat16"), ("tiny-sd3", "float16")])
def test_streamed_folder_is_the_one_save_pretrained_writes(tmp_path, name, dtype):
    """Same files, same configs, indexes and model_index.json byte for byte, same keys, shapes and dtypes in the
    same shards: T5's tied embedding written once, SD3's positional buffer (fp32) in, no non-persistent buffer."""
    recipe = streamed(name, dtype)
    eager, stream = tmp_path / "eager", tmp_path / "streamed"
    build(recipe).save_pretrained(eager, safe_serialization=True, max_shard_size=SMALL_SHARDS)
    save_streamed(recipe, stream, max_shard_size=SMALL_SHARDS)
    assert files(stream) == files(eager)
    for file in files(eager):
        if not file.endswith(".safetensors"):
            assert (stream / file).read_bytes() == (eager / file).read_bytes(), file
    assert tensor_layout(stream) == tensor_layout(eager)
    layout = tensor_layout(stream)
    t5 = "text_encoder_3" if name == "tiny-sd3" else "text_encoder_2"
    t5_keys = {key for file, key in layout if file.startswith(t5)}
    assert "shared.weight" in t5_keys and "encoder.embed_tokens.weight" not in t5_keys
    if name == "tiny-sd3":
        assert {v for (_, key), v in layout.items() if key == "pos_embed.pos_embed"} == {("F32", (1, 96 * 96, 32))}
        # Its two CLIPs have the same keys and shapes: each component is seeded apart.
        key = "text_model.encoder.layers.0.mlp.fc1.weight"
        assert not torch.equal(weights(stream / "text_encoder")[key], weights(stream / "text_encoder_2")[key])


def test_shards_and_index_say_where_each_tensor_is(tiny_flux_streamed):
    folder = tiny_flux_streamed / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert shards[0].name == f"diffusion_pytorch_model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:
        with safe_open(shard, "pt") as f:
            assert {k for k, v in index["weight_map"].items() if v == shard.name} == set(f.keys())
    tensors = weights(folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    t5_index = json.loads((tiny_flux_streamed / "text_encoder_2" / "model.safetensors.index.json").read_text())
    assert t5_index["metadata"]["total_parameters"] == sum(
        t.numel() for t in weights(tiny_flux_streamed / "text_encoder_2").values()
    )


def test_one_network_only_is_that_network_of_the_whole_folder(tiny_flux_streamed, tmp_path):
    """``networks``: the same transformer bytes and the pipeline's configs, no other network's weights."""
    save_streamed(streamed("tiny-flux", "bfloat16"), tmp_path, max_shard_size=SMALL_SHARDS, networks=("transformer",))
    assert not [path for path in tmp_path.rglob("*.safetensors*") if path.parts[-2] != "transformer"]
    for file in files(tmp_path):
        assert (tmp_path / file).read_bytes() == (tiny_flux_streamed / file).read_bytes(), file


def test_a_grown_network_is_written_in_the_dtype_asked(tiny_flux_streamed, tmp_path):
    """big_export's --blocks on a bf16 preset: the grown transformer in bf16 (half fp32's disk), the tensors it
    shares with the source's by name holding the source's values."""
    from sdtrt.sources.preset_build import with_network_config

    config = json.loads((tiny_flux_streamed / "transformer" / "config.json").read_text())
    grown = with_network_config(
        tiny_flux_streamed, "transformer", tmp_path / "grown", dtype="bfloat16", num_layers=config["num_layers"] + 1
    )
    source, more = weights(tiny_flux_streamed / "transformer"), weights(grown / "transformer")
    assert {value.dtype for value in more.values()} == {torch.bfloat16}
    assert len(more) > len(source)
    for key, value in source.items():
        assert torch.equal(more[key], value), key


def test_shards_are_the_bytes_safetensors_writes(tiny_flux_streamed):
    """Header order, padding and metadata as safetensors' own writer makes them for the same tensors."""
    again = tiny_flux_streamed.parent / "resaved.safetensors"
    for shard in sorted(tiny_flux_streamed.rglob("*.safetensors")):
        save_file(load_file(shard), again, metadata={"format": "pt"})
        assert again.read_bytes() == shard.read_bytes(), shard


def test_streamed_pipeline_loads_with_its_values_and_generates(tiny_flux_streamed):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_flux_streamed, torch_dtype=torch.float32)
    assert type(pipe).__name__ == "FluxPipeline"
    for component in ("transformer", "vae", "text_encoder"):
        on_disk = weights(tiny_flux_streamed / component)
        loaded = getattr(pipe, component).state_dict()
        assert on_disk.keys() <= loaded.keys()
        assert all(torch.equal(loaded[k], v.float()) for k, v in on_disk.items()), component  # nothing re-initialised
    t5 = pipe.text_encoder_2
    assert t5.encoder.embed_tokens.weight is t5.shared.weight
    alone = diffusers.FluxTransformer2DModel.from_pretrained(
        tiny_flux_streamed / "transformer", torch_dtype=torch.bfloat16
    )
    on_disk, loaded = weights(tiny_flux_streamed / "transformer"), alone.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in on_disk.items())
    image = pipe("a photo", num_inference_steps=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert image.shape == (1, 64, 64, 3) and image.std() > 0.01


def test_values_are_seeded_per_tensor_and_scaled(tiny_flux_streamed, tmp_path):
    """The same values whatever the shard size (and run to run); matrices ~ 1/√fan-in, norm gains near 1, biases
    small."""
    save_streamed(streamed("tiny-flux", "bfloat16"), tmp_path, max_shard_size=10**9)
    for component in ("transformer", "text_encoder_2"):
        a, b = weights(tiny_flux_streamed / component), weights(tmp_path / component)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tensors = weights(tmp_path / "transformer")
    proj = tensors["transformer_blocks.0.ff.net.2.weight"].float()
    assert abs(proj.std().item() * math.sqrt(proj.shape[1]) - 1) < 0.1
    gain = tensors["transformer_blocks.0.attn.norm_q.weight"].float()
    assert abs(gain.mean().item() - 1) < 0.02 and 0 < gain.std().item() < 0.05
    assert tensors["proj_out.bias"].float().abs().max().item() < 0.2


def test_an_interrupted_streamed_preset_leaves_nothing(tmp_path, monkeypatch):
    """A write that fails half way (a file-size limit: the disk filling up) leaves neither the preset nor its
    temporary folder."""
    monkeypatch.setitem(PRESETS, "tiny-sd3-streamed", dataclasses.replace(PRESETS["tiny-sd3"], streamed=True))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    try:
        with pytest.raises(OSError) as failure:
            ensure_preset("tiny-sd3-streamed", tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert failure.value.errno == errno.EFBIG
    assert any(entry.name == "write_safetensors" for entry in failure.traceback)  # it failed writing weights
    assert list(tmp_path.iterdir()) == []
    assert (ensure_preset("tiny-sd3-streamed", tmp_path) / "model_index.json").is_file()


@pytest.mark.parametrize(
    ("preset", "parameters", "blocks"),
    [("flux-random", 11_901_408_320, {"transformer_blocks": 19, "single_transformer_blocks": 38}),
     ("sd35-large-random", 8_056_627_520, {"transformer_blocks": 38}),
     ("flux2-klein-random", 3_875_544_576, {"transformer_blocks": 5, "single_transformer_blocks": 20}),
     ("qwen-image-random", 20_430_401_088, {"transformer_blocks": 60})],
)  # fmt: skip
def test_scale_presets_have_the_real_transformers(preset, parameters, blocks):
    """FLUX.1 dev's 11.9 B-parameter transformer (its 23.8 GB bf16 checkpoint), SD3.5 Large's 8.1 B, FLUX.2 [klein]
    4B's 3.9 B and Qwen-Image's 20.4 B (its 40.9 GB bf16 checkpoint), counted on the meta device."""
    import diffusers

    recipe = PRESETS[preset]
    class_name, kwargs = recipe.denoiser
    with torch.device("meta"):
        transformer = getattr(diffusers, class_name)(**kwargs)
    assert recipe.streamed and recipe.dtype == "bfloat16"
    assert sum(p.numel() for p in transformer.parameters()) == parameters
    assert {name: len(getattr(transformer, name)) for name in blocks} == blocks
    width = {"sd35-large-random": 2432}.get(preset, 3072)  # 24 heads × 128 but SD3.5 Large's 38 × 64
    assert transformer.config.num_attention_heads * transformer.config.attention_head_dim == width


@pytest.mark.parametrize(
    ("preset", "parameters", "language_model"),
    [("flux2-klein-random", 4_022_468_096, 4_022_468_096),  # Qwen3-4B, its embedding tied to the LM head
     ("qwen-image-random", 8_292_166_656, 7_070_619_136)],  # Qwen2.5-VL-7B-Instruct: 8.29 B with its vision tower
)  # fmt: skip
def test_scale_presets_have_the_real_llm_text_encoders(preset, parameters, language_model):
    """The LLM encoders as published, counted on the meta device: every parameter (a tied one once), and the
    decoder stack the engine runs (no LM head, no vision tower)."""
    import transformers

    class_name, kwargs = PRESETS[preset].text_encoders[0]
    cls = getattr(transformers, class_name)
    with torch.device("meta"):
        encoder = cls(cls.config_class(**kwargs))
    assert encoder.num_parameters() == parameters
    decoder = getattr(encoder.model, "language_model", encoder.model)
    assert decoder.num_parameters() == language_model


def test_a_partial_preset_writes_only_the_networks_named(tmp_path, monkeypatch):
    """qwen-image-random's way onto a 64 GB disk: the text encoder's weights alone, every network's config (the
    folder still reads as the pipeline), in a folder apart from the whole preset's."""
    monkeypatch.setitem(PRESETS, "tiny-qwen-streamed", dataclasses.replace(PRESETS["tiny-qwen-image"], streamed=True))
    folder = ensure_preset("tiny-qwen-streamed", tmp_path, networks=("text_encoder",))
    assert folder.name.endswith("-only-text_encoder")
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert list((folder / "text_encoder").glob("*.safetensors"))
    for network in ("transformer", "vae"):
        assert (folder / network / "config.json").is_file() and not list((folder / network).glob("*.safetensors"))


def test_a_partial_preset_refuses_what_it_cannot_write_and_reuses_the_whole_one(tmp_path, monkeypatch):
    """A name that is not one of the pipeline's networks, or a preset built whole, is refused before any file is
    written; a whole preset already built serves the partial one (no second copy of its weights)."""
    from sdtrt.core.errors import RequestError

    monkeypatch.setitem(PRESETS, "tiny-qwen-streamed", dataclasses.replace(PRESETS["tiny-qwen-image"], streamed=True))
    with pytest.raises(RequestError, match=r"^text-encoder: not a network of this pipeline; its networks are .*vae"):
        ensure_preset("tiny-qwen-streamed", tmp_path, networks=("text-encoder",))
    with pytest.raises(RequestError, match="preset tiny-qwen-image is built whole"):
        ensure_preset("tiny-qwen-image", tmp_path, networks=("text_encoder",))
    assert list(tmp_path.iterdir()) == []
    whole = ensure_preset("tiny-qwen-streamed", tmp_path)
    assert ensure_preset("tiny-qwen-streamed", tmp_path, networks=("text_encoder",)) == whole
