"""Step caches from the command line (issue 36): `compile --caches`, `--cache` on generate, bench, validate and
deploy triton, `calibrate-cache` and `--cache auto`, and the perceptual scores a cached run is reported with. The
engine-level checks against diffusers are in tests/test_step_cache.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import sdtrt
from sdtrt.sources.models import resolve_model
from sdtrt.tools.image_quality import psnr_db

from .helpers import run_cli


def test_the_cli_builds_the_split_and_runs_a_cache_in_generate_and_bench(cached_sets, tmp_path):
    built = run_cli("compile", "--model", "tiny-flux", "--target", "onnxruntime", "--precision", "fp32",
                    "--caches", "first-block", "--no-validate", check=True)  # fmt: skip
    assert built.stdout.strip().splitlines()[-1] == str(cached_sets("tiny-flux").path)
    image = tmp_path / "cat.png"
    size = ("--height", "128", "--width", "128")
    run_cli("generate", "--engine", str(cached_sets("tiny-flux").path), "--cache", "first-block:0.3", "--steps", "10",
            *size, "--out", str(image), check=True)  # fmt: skip
    assert image.stat().st_size > 0
    report = tmp_path / "bench.json"
    run_cli("bench", "--model", "tiny-flux", "--backends", "onnxruntime:fp32", "--steps", "10", "--repeats", "1",
            "--warmup", "0", *size, "--cache", "first-block:0.3", "--json", str(report), check=True)  # fmt: skip
    cached = json.loads(report.read_text())["backends"][0]["step_cache"]
    assert cached["denoiser_calls"] == 10 and 0 < cached["full_evaluations"] < 10
    assert cached["skipped_share"] == pytest.approx(1 - cached["full_evaluations"] / 10)
    assert cached["psnr_db"] > 35 and 0.9 < cached["ssim"] <= 1.0


def test_the_cli_refuses_a_cache_in_one_line_before_loading_anything(fp32_engine_sets, tmp_path):
    unet = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", "--caches", "first-block")
    assert unet.returncode == 2 and "its denoiser is a UNet; use --caches deepcache" in unet.stderr
    for value in ("high", "nan"):
        malformed = run_cli("generate", "--model", "tiny-flux", "--cache", f"first-block:{value}")
        assert malformed.returncode == 2 and f"'{value}' is not a number" in malformed.stderr
    report = tmp_path / "report.json"
    plain = str(fp32_engine_sets("tiny-flux").path)
    for command, extra in (("generate", ("--out", str(tmp_path / "x.png"))), ("validate", ("--json", str(report)))):
        refused = run_cli(command, "--engine", plain, "--cache", "first-block:0.3", *extra)
        assert refused.returncode == 2 and "recompile it with `sdtrt compile --caches first-block`" in refused.stderr
        assert refused.stderr.count("\n") == 1 and not report.exists()  # one line, before anything ran
    sd3 = run_cli("generate", "--model", "tiny-sd3", "--cache", "magcache")
    assert sd3.returncode == 2 and "diffusers publishes for Flux.1 only" in sd3.stderr


def test_calibrate_cache_stores_the_boldest_setting_within_the_target_and_auto_uses_it(cached_sets, tmp_path):
    """The command line once each way (calibrate-cache, generate --cache auto); the rest through the functions they
    call (tools/cache_calibration.py, cli/request_options.py resolve_cache): a CLI call costs seconds of start-up."""
    from sdtrt.cli.request_options import resolve_cache
    from sdtrt.core.config import CALIBRATION_PROMPTS, CacheCalibrationConfig
    from sdtrt.core.errors import RequestError
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.cache_calibration import calibrate_step_cache

    set_ = cached_sets("tiny-flux")
    engine, model = str(set_.path), resolve_model("tiny-flux")
    short = {"steps": 4, "prompts": CALIBRATION_PROMPTS[:1], "height": 128, "width": 128}
    found = run_cli("calibrate-cache", "--engine", engine, "--min-psnr", "60", "--steps", "4", "--prompts", "1",
                    "--height", "128", "--width", "128", check=True)  # fmt: skip
    calibration = json.loads((Path(found.stdout.strip().splitlines()[-1]) / "calibration.json").read_text())
    kept = [row for row in calibration["tried"] if row["min_psnr_db"] is None or row["min_psnr_db"] >= 60]
    assert calibration["chosen"] == kept[-1] and len(kept) == len(calibration["tried"]) - (kept != calibration["tried"])
    image = tmp_path / "auto.png"
    used = run_cli("generate", "--engine", engine, "--cache", "auto", "--steps", "4", "--height", "128", "--width",
                   "128", "--out", str(image), check=True)  # fmt: skip
    assert f"--cache auto: {calibration['chosen']['cache']}" in used.stderr

    def auto(text: str = "auto", steps: int = 4) -> str:
        cache = resolve_cache(text, set_, model, steps, None)
        assert cache is not None
        return cache.label

    with pytest.raises(RequestError, match=r"no calibration.*--steps 5"):
        auto(steps=5)
    # The newest calibration is the one auto reads (a run asked again, a cache hit, becomes the newest); auto:KIND
    # reads the newest of that kind.
    taylorseer = calibrate_step_cache(model, set_, CacheCalibrationConfig("taylorseer", 20, **short)).manifest["cache"]
    assert (auto(), auto("auto:first-block")) == (taylorseer, calibration["chosen"]["cache"])
    calibrate_step_cache(model, set_, CacheCalibrationConfig("first-block", 60, **short))  # a cache hit
    assert auto() == calibration["chosen"]["cache"]
    # TaylorSeer predicts some steps at its most cautious interval already: no image stays unchanged.
    unreachable = calibrate_step_cache(model, set_, CacheCalibrationConfig("taylorseer", 1000, **short))
    assert unreachable.manifest["cache"] is None
    with pytest.raises(RequestError, match="found no setting that kept 1000 dB"):
        auto()


def test_a_triton_deployment_runs_every_request_with_its_step_cache(cached_sets, fp32_engine_sets, tmp_path):
    from sdtrt.pipeline.request import GenerateRequest
    from sdtrt.serving.deploy import Deployment, TritonDeployConfig, deploy_triton
    from sdtrt.serving.triton_model import TritonPythonModel

    refused = run_cli("deploy", "triton", "--engine", str(fp32_engine_sets("tiny-flux").path), "--out",
                      str(tmp_path / "plain"), "--cache", "first-block:0.3")  # fmt: skip
    assert refused.returncode == 2 and "--caches first-block" in refused.stderr
    assert not (tmp_path / "plain").exists()
    written = deploy_triton(cached_sets("tiny-flux"), tmp_path / "repo", TritonDeployConfig(cache="first-block:0.3"))
    model = TritonPythonModel()  # as initialize leaves it, without Triton's process around it
    model.deployment = Deployment.open(written.folder)
    pipe = sdtrt.load_pipeline("tiny-flux", engine=written.engine)
    model.pipes = {"txt2img": pipe}
    model.stop_file, model.server_pid = None, os.getppid()
    rows = [GenerateRequest(prompt="a cat", steps=10, height=128, width=128)]
    rest = pipe.transformer.opened_split().rest
    cached = np.asarray(model.generate("txt2img", rows).images[0], dtype=np.float64) / 255
    assert rest.calls < 10 and not pipe.transformer.is_cache_enabled  # skipped steps; off between requests
    uncached = np.asarray(sdtrt.generate(pipe, rows[0]).images[0], dtype=np.float64) / 255
    assert 30 < psnr_db(cached, uncached) < 80


def test_perceptual_scores_read_a_local_clip_model_and_say_what_they_could_not_measure(tmp_path, monkeypatch):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    from sdtrt.tools.image_quality import CLIP_MODEL_ENV, clip_score, perceptual_scores

    tokenizer = CLIPTokenizer.from_pretrained(resolve_model("tiny").path / "tokenizer")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"vocab_size": tokenizer.vocab_size, "hidden_size": 32, "intermediate_size": 37,
                     "num_hidden_layers": 2, "num_attention_heads": 4},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 2, "num_attention_heads": 4},
        projection_dim=16,
    )  # fmt: skip
    CLIPModel(config).save_pretrained(tmp_path)
    CLIPProcessor(CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32), tokenizer).save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    image, other = rng.random((1, 48, 48, 3)), rng.random((1, 48, 48, 3))
    score = clip_score(image, "a cat", str(tmp_path))
    assert 0.0 <= score <= 100.0 and score == pytest.approx(clip_score(image.copy(), "a cat", str(tmp_path)))
    assert score != pytest.approx(clip_score(other, "a cat", str(tmp_path)))  # it reads the image
    monkeypatch.delenv(CLIP_MODEL_ENV, raising=False)
    assert "clip_score" in perceptual_scores(image, other, "a cat")["not_measured"]
    monkeypatch.setenv(CLIP_MODEL_ENV, str(tmp_path))
    scores = perceptual_scores(image, other, "a cat")
    assert scores["clip_score"] == pytest.approx(score, abs=1e-3)
    assert "lpips" in scores or "lpips" in scores["not_measured"]  # measured where the lpips package is installed
