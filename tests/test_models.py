"""Model sources: presets built offline and cached, clear errors for everything else."""

from __future__ import annotations

import json
import re

import pytest

from sdtrt.core.errors import ModelNotFoundError, UnsupportedModelError
from sdtrt.core.families import check_supported_unet
from sdtrt.sources.models import resolve_model


def test_tiny_preset_is_a_complete_cached_pipeline(tiny):
    assert tiny.kind == "preset" and tiny.is_pipeline
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny.path / part).is_dir()
    assert tiny.vae_scale_factor() == 8
    stamp = (tiny.path / "unet" / "config.json").stat().st_mtime_ns
    again = resolve_model("tiny")
    assert again.path == tiny.path and (again.path / "unet" / "config.json").stat().st_mtime_ns == stamp
    assert again.denoiser_digest() == tiny.denoiser_digest()


def test_tiny_tokenizer_has_a_real_vocabulary(tiny):
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tiny.path / "tokenizer")
    assert len(tokenizer) > 500
    ids = tokenizer("a photo of the astronaut, ünïcode 🚀", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and max(ids) < len(tokenizer)
    assert len(set(ids)) > 10


def test_local_folder_and_bare_unet_folder(tiny):
    assert resolve_model(str(tiny.path)).kind == "folder"
    unet_only = resolve_model(str(tiny.path / "unet"))
    assert not unet_only.is_pipeline and unet_only.denoiser_digest() == tiny.denoiser_digest()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("no-such-preset", "is not a preset"),
        ("/definitely/missing/folder", "is not a preset"),
        ("some-org/not-downloaded", "could not be found or downloaded"),
    ],
)
def test_unresolvable_models_say_what_to_pass(value, message):
    with pytest.raises(ModelNotFoundError, match=message):
        resolve_model(value)


def test_folder_that_is_not_diffusers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelNotFoundError, match="is not a diffusers model"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"class_embed_type": "timestep"}, "class-label conditioning"),
     ({"addition_embed_type": "image"}, "added conditioning of type 'image'"),
     ({"encoder_hid_dim_type": "text_proj"}, "projected encoder hidden states"),
     ({"_class_name": "SD3Transformer2DModel"}, "SD3Transformer2DModel")],
)  # fmt: skip
def test_unsupported_conditioning_is_refused_saying_what_is_supported(tiny, extra, named):
    with pytest.raises(UnsupportedModelError, match=f"{re.escape(named)}.*; sdtrt supports SD 1.x and 2.x"):
        check_supported_unet(tiny.unet_config() | extra)


def test_folder_digest_hashes_a_weight_file_once_and_again_when_it_changes(tiny, tmp_path):
    import shutil

    from sdtrt.sources import models

    folder = tmp_path / "model"
    shutil.copytree(tiny.path, folder)
    source = resolve_model(str(folder))
    first = source.folder_digest("unet")
    hashed = models._weights_sha256.cache_info().misses
    assert source.folder_digest("unet") == first
    assert models._weights_sha256.cache_info().misses == hashed  # the second key of one command hashes nothing

    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size, new content
    assert source.folder_digest("unet") != first
