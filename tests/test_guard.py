"""The accuracy guard (issue 22): a layer made hard to quantize on purpose is found, returned to high precision,
and the target met; an unreachable target exits 3."""

from __future__ import annotations

import shutil

import pytest
import torch

from sdtrt.core.config import DEFAULT_PROMPT, QuantizeConfig
from sdtrt.sources.models import resolve_model
from sdtrt.tools.guard import GuardConfig, guard, worst_layers

from .helpers import run_cli

HARD = "up_blocks.1.attentions.1.transformer_blocks.0.ff.net.2"
QUANT = QuantizeConfig(precision="int8", calibration_prompts=(DEFAULT_PROMPT,), calibration_steps=2)
# HARD feeds the last transformer block's output (down_blocks.0's, as before, moved the image by 1.3 dB only: too
# narrow a gap to place a target in). Measured (ONNX Runtime CPU, 10 steps at 256², seed 0): 37.5 dB with HARD
# quantized, 42.4 dB with HARD kept in high precision (the other 53 quantized layers cost the rest); the ranking
# gives HARD 0.79, the next layer 0.033. The target sits midway, 2.5 dB from either.
TARGET_DB = 40.0


@pytest.fixture(scope="module")
def outlier_model(tiny, tmp_path_factory):
    """tiny with an outlier input channel in one feed-forward Linear (HARD): GEGLU's hidden channel 0 made 1000×
    smaller in ff.net.0.proj and HARD's column 0 1000× larger. fp32 computes the same function; in 8 bits HARD's
    per-row weight scales and its per-tensor input scale are each dominated by that one channel."""
    from diffusers import UNet2DConditionModel

    folder = tmp_path_factory.mktemp("outlier") / "model"
    shutil.copytree(tiny.path, folder)
    unet = UNet2DConditionModel.from_pretrained(folder / "unet")
    feed_forward = unet.get_submodule(HARD.removesuffix(".net.2"))
    with torch.no_grad():
        feed_forward.net[0].proj.weight[0] /= 1000
        feed_forward.net[0].proj.bias[0] /= 1000
        feed_forward.net[2].weight[:, 0] *= 1000
    unet.save_pretrained(folder / "unet")
    return resolve_model(str(folder))


def test_the_worst_layers_leave_out_those_already_kept():
    errors = {"a": 0.5, "b": 0.9, "c": 0.1, "d": 0.7}
    assert worst_layers(errors, 2) == ["b", "d"]
    assert worst_layers(errors, 2, kept=["b"]) == ["d", "a"]


@pytest.mark.slow  # 62 s; test_an_unreachable_target_exits_3_in_one_line runs the guard's loop in the default suite
def test_the_guard_finds_the_outlier_layer_and_meets_the_target(outlier_model, store):
    config = GuardConfig(min_psnr_db=TARGET_DB, layers_per_round=1)
    report = guard(outlier_model, store, QUANT, config, target="onnxruntime", components=("unet",))
    print(f"\nguard rounds: {report.rounds}")
    first = report.rounds[0]
    assert first.psnr_db < TARGET_DB and first.returned[0] == HARD, first
    assert report and len(report.rounds) <= 3 and HARD in report.kept
    assert report.rounds[-1].psnr_db >= TARGET_DB
    assert report.result.validation is not None and report.result.validation.image["psnr_db"] >= TARGET_DB


def test_an_unreachable_target_exits_3_in_one_line(outlier_model):
    args = ["compile", "--model", str(outlier_model.path), "--target", "onnxruntime", "--components", "unet"]
    args += ["--precision", "int8", "--calibration-prompts", "1", "--calibration-steps", "2"]
    # A budget no case fits in: the largest case is compared, the others are over it (the guard's validation too).
    unreachable = run_cli(*args, "--min-psnr", "200", "--guard-rounds", "1", "--memory-budget", "1KiB")
    assert unreachable.returncode == 3, unreachable.stderr
    assert "over the 1.0 KiB budget" in unreachable.stderr + unreachable.stdout
    assert "guard: round 1: image PSNR" in unreachable.stderr and "(target 200)" in unreachable.stderr
    last = unreachable.stderr.strip().splitlines()[-1]
    assert "stays at" in last and "< 200 dB after 1 rounds" in last
    misused = run_cli("compile", "--model", "tiny", "--min-psnr", "30")  # fp16: no guard to run
    assert misused.returncode == 2 and "--min-psnr is the accuracy guard" in misused.stderr
