"""Validation: passes for a good engine, fails (exit 3) and shows where for broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from sdtrt.core.artifact import Artifact
from sdtrt.core.errors import ParityError
from sdtrt.tools.image_quality import psnr_db
from sdtrt.tools.validate import ValidationConfig, image_problems, validate

from .helpers import last_line, run_cli

FAST = ValidationConfig(steps=4)
TENSORS = ValidationConfig(images=False)  # a broken engine fails on the tensors already: no images to generate


def broken_copy(engine: Artifact, folder: Path, change) -> Path:
    """A bare .onnx copy of the engine's source graph with one initializer changed."""
    source = Artifact.open(engine.manifest["inputs"][0]["path"]).primary  # the simplified graph
    model = onnx.load(str(source))
    weights = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16 and len(t.dims) == 4]
    target = change(weights)
    array = numpy_helper.to_array(target)
    target.CopyFrom(numpy_helper.from_array(change.apply(array), target.name))
    path = folder / "broken.onnx"
    onnx.save(model, str(path))
    return path


class Perturb:
    """Add noise of the weights' own size to the largest conv: a wrong but finite engine."""

    def __call__(self, weights):
        return max(weights, key=lambda t: np.prod(t.dims))

    @staticmethod
    def apply(array):
        noise = np.random.default_rng(0).standard_normal(array.shape) * array.std()
        return (array + noise).astype(np.float16)


class Overflow:
    """Scale the last conv (the output projection) past fp16's range: inf/NaN outputs."""

    def __call__(self, weights):
        return weights[-1]

    @staticmethod
    def apply(array):
        return np.full_like(array, 60000.0)


def test_good_engine_passes(tiny, tiny_engine):
    report = validate(tiny, tiny_engine, FAST)
    assert report, report.failures
    report.raise_for_status()
    assert len(report.tensors) == 5
    assert {row["case"].split()[1] for row in report.tensors} == {"128x128", "256x256", "384x384"}
    assert min(row["cosine"] for row in report.tensors) >= 0.999
    assert report.image["psnr_db"] >= 30.0
    assert report.to_json()["passed"] is True


def test_perturbed_weights_fail_with_exit_3_and_show_where(tiny, tiny_engine, tmp_path):
    broken = broken_copy(tiny_engine, tmp_path, Perturb())
    report = validate(tiny, Artifact.open(broken), TENSORS)
    assert not report
    assert any("cosine" in f for f in report.failures)
    with pytest.raises(ParityError, match="engine does not match PyTorch"):
        report.raise_for_status()

    result = run_cli(  # a hand-made copy records no model: --model names it; the tensors fail, images add nothing
        "validate", "--model", "tiny", "--engine", str(broken), "--no-images", "--json", str(tmp_path / "r.json")
    )
    assert result.returncode == 3
    assert "FAIL" in result.stdout, "the report table is the command's result: stdout"
    assert result.stderr.strip().splitlines()[-1].startswith("error: engine does not match PyTorch")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["passed"] is False and saved["tensors"][0]["failures"]
    assert "report: " + str(tmp_path / "r.html") in result.stderr, "its HTML report beside the JSON (sdtrt report)"
    assert 'class="failed"' in (tmp_path / "r.html").read_text(), "the failing rows shown as failed"


def test_fp16_overflow_is_caught_as_nan(tiny, tiny_engine, tmp_path):
    broken = broken_copy(tiny_engine, tmp_path, Overflow())
    report = validate(tiny, Artifact.open(broken), TENSORS)
    assert not report
    assert any("NaN or inf" in f for f in report.failures)


def test_cli_validate_and_generate_with_the_engine(tiny, tiny_engine, tmp_path):
    report = tmp_path / "new" / "deeper" / "v.json"  # its folder is made
    result = run_cli(
        "validate", "--engine", str(tiny_engine.path), "--no-images", "--json", str(report), "--no-report", check=True
    )
    assert last_line(result.stdout) == "parity: PASS" and "b8 384x384" in result.stdout
    assert json.loads(report.read_text())["tensors"], "the report as JSON"
    assert not report.with_suffix(".html").exists(), "--no-report: the JSON alone"

    from PIL import Image

    images = {}
    for name, extra in (("engine", ["--engine", str(tiny_engine.path)]), ("torch", [])):
        out = tmp_path / f"{name}.png"
        args = ["generate", "--prompt", "a lighthouse", "--steps", "4", "--seed", "7", "--height", "128"]
        run_cli(*args, "--width", "128", "--out", str(out), *extra, check=True)
        images[name] = np.asarray(Image.open(out), dtype=np.float32) / 255
    assert images["engine"].shape == (128, 128, 3)
    assert psnr_db(images["engine"], images["torch"]) >= 30.0


def test_image_guards():
    assert image_problems(np.zeros((8, 8, 3))) == ["is all black"]
    assert image_problems(np.full((8, 8, 3), 0.5))[0].startswith("is constant")
    assert image_problems(np.full((8, 8, 3), np.nan)) == ["contains NaN or inf"]
    assert image_problems(np.random.default_rng(0).random((8, 8, 3))) == []
    assert psnr_db(np.ones(4), np.ones(4)) == float("inf")


def test_an_sdxl_vae_with_latent_statistics_decodes_as_sdxl_not_as_qwen_image(tiny):
    """An AutoencoderKL may carry latents_mean / latents_std (Playground v2.5's, read by its SDXL pipeline): validate
    decodes its 4-D latents as an AutoencoderKL's, keying Qwen-Image's one-frame decode on the VAE's class alone."""
    import torch

    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.tools.validate import _decode

    pipe = load_pipeline(tiny)
    channels = pipe.vae.config.latent_channels
    pipe.vae.register_to_config(latents_mean=[0.1] * channels, latents_std=[0.9] * channels)
    image = _decode(pipe, torch.randn(1, channels, 8, 8), GenerateRequest(height=64, width=64))
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()
