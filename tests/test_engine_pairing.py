"""Engines and models that belong together: any single network validates, a foreign model is refused in
one line, and compile reuses the validation report stored with its engines (read-only stores too)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sdtrt.core.errors import EngineMismatchError
from sdtrt.graph.onnx_graph import artifact_spec
from sdtrt.sources.models import resolve_model
from sdtrt.spec import DenoiserSpec
from sdtrt.stages.engine_set import check_pairing, engine_members, engine_profile
from sdtrt.tools.compile import compile_model
from sdtrt.tools.validate import ValidationConfig, validate

from .helpers import REPO, last_line, private_store, run_cli
from .test_cli import _without_dac_override

FAST = ValidationConfig(steps=3)


@pytest.mark.parametrize(
    ("preset", "component"),
    [("tiny", "vae_decoder"), ("tiny", "text_encoder"), ("tiny-controlnet", "controlnet")],
)
def test_a_single_network_other_than_the_unet_validates(preset, component, store):
    model = resolve_model(preset)
    result = compile_model(model, store, target="onnxruntime", components=(component,), validation=FAST)
    report = result.validation
    assert report, report.failures
    assert {row["case"].split()[0] for row in report.tensors} == {component}, "compared with its own network"
    profile = engine_profile(engine_members(result.final))
    assert profile is not None
    spec = artifact_spec(result.final)
    batches = spec.batch_range(profile)
    for row in report.tensors:  # a denoiser's cases span the schedule, at batches its engine was built for
        assert batches.min <= int(row["case"].split()[1][1:]) <= batches.max, row["case"]
        assert ("t=" in row["case"]) == isinstance(spec, DenoiserSpec), row["case"]
    assert report.image["psnr_db"] >= 30.0
    assert list(engine_members(result.final)) == [component]


def test_validate_refuses_an_engine_with_another_familys_model_in_one_line(tiny_engine, tmp_path):
    for other, why in (
        ("tiny-sdxl", "(sd1 vs sdxl): 'encoder_hidden_states' is float16 ['batch', 77, 32] in the engine, "
         "float16 ['batch', 77, 64] for the model"),
        ("tiny-sd2", "(sd1 vs sd2-v): its weights differ from the model's unet/ (content hash)"),
    ):  # fmt: skip
        result = run_cli("validate", "--engine", str(tiny_engine.path), "--model", other, "--json", str(tmp_path / "r"))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr
        assert f"the UNet engine {tiny_engine.path} was made from tiny, not {other} {why}" in result.stderr
        assert "pass the model it was made from as --model" in result.stderr
    # Every command that takes --engine and --model checks the pair before loading (generate leaked an
    # "unexpected FileNotFoundError" for a Flux model: it has no unet/).
    out = tmp_path / "never.png"
    result = run_cli(
        "generate", "--engine", str(tiny_engine.path), "--model", "tiny-flux", "--steps", "1", "--out", str(out)
    )
    assert result.returncode == 2 and "was made from tiny, not tiny-flux (sd1 vs flux): tiny-flux has no unet/" in (
        result.stderr
    ), result.stderr
    assert not out.exists()


def test_same_shapes_other_weights_are_refused_and_a_copy_of_the_model_is_not(tiny, tiny_engine, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny.path, copy)
    check_pairing(engine_members(tiny_engine), resolve_model(str(copy)))  # content, not the path, decides

    from safetensors.torch import load_file, save_file

    weights = next((copy / "unet").glob("*.safetensors"))
    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, weights)
    with pytest.raises(EngineMismatchError, match=r"its weights differ from the model's unet/ \(content hash\)"):
        validate(resolve_model(str(copy)), tiny_engine, FAST)


@pytest.mark.slow  # 44 s: a whole set copied into a read-only store and compiled again there
def test_compile_reuses_the_stored_report_and_serves_a_read_only_store(tmp_path, tiny_engine):
    engines = private_store(tiny_engine, tmp_path / "engines")  # made read-only below; export and simplify are hits
    args = ("compile", "--target", "onnxruntime", "--components", "unet", "--engines", str(engines))
    first = run_cli(*args, "--height", "128:128:256", "--width", "128:128:256", check=True)
    again = ("--height", "128:128:256", "--width", "128:128:256")
    second = run_cli(*args, *again, check=True)
    assert "Comparing UNet outputs" in first.stderr and "validate: cached" not in first.stderr
    assert "Comparing UNet outputs" not in second.stderr and "validate: cached report" in second.stderr
    assert "engine vs PyTorch fp32" in second.stderr, "the stored report is shown"
    assert last_line(second.stdout) == last_line(first.stdout)
    forced = run_cli(*args, *again, "--revalidate", check=True)
    assert "Comparing UNet outputs" in forced.stderr and "validate: cached" not in forced.stderr

    subprocess.run(["chmod", "-R", "a-w", str(engines)], check=True)
    try:
        read_only = subprocess.run(
            [*_without_dac_override(), sys.executable, "-m", "sdtrt", *args, *again],
            capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
    finally:
        subprocess.run(["chmod", "-R", "u+w", str(engines)], check=True)
    assert read_only.returncode == 0, read_only.stderr
    assert last_line(read_only.stdout) == last_line(first.stdout)
    assert "validate: cached report" in read_only.stderr and "build-ort: cached" in read_only.stderr
    assert not any(Path(engines, ".tmp").iterdir())
