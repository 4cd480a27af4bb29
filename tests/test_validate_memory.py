"""Validation on the CPU stays within the host's memory: a case projected over it is reported, not run.

SD 1.5's largest default case (batch 8 at 768²) would make ONNX Runtime hold ~22 GB of attention scores for one
layer; on a 24 GB machine the kernel killed the validation. These tests use a budget in place of a small machine.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli


def test_a_case_projected_over_the_memory_budget_is_reported_not_run(tiny_engine, tmp_path):
    result = run_cli(
        "validate", "--engine", str(tiny_engine.path), "--model", "tiny", "--no-images", "--memory-budget", "1MB",
        "--json", str(tmp_path / "report.json"),
    )  # fmt: skip

    assert result.returncode == 0, result.stderr  # what was compared passes; the skipped case is listed, not failed
    report = json.loads((tmp_path / "report.json").read_text())
    compared = [row["case"] for row in report["tensors"]]
    # The optimum (measured first) and the smallest shape are compared; only the largest is projected over 1 MB.
    assert len(compared) == 4 and not any("384x384" in case for case in compared), compared
    assert len(report["skipped"]) == 1, report["skipped"]
    assert report["skipped"][0].startswith("b8 384x384 t=250: not compared:")
    assert "over the 1.0 MB budget" in report["skipped"][0]
    assert "! b8 384x384 t=250: not compared:" in result.stdout and "raise --memory-budget" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "parity: PASS (1 case(s) not compared: see above)"
    # Without a budget nothing of tiny is skipped: test_validate.py::test_good_engine_passes compares all 5 cases.


def test_a_malformed_memory_budget_is_one_line_before_anything_loads(tiny_engine):
    result = run_cli("validate", "--engine", str(tiny_engine.path), "--model", "tiny", "--memory-budget", "0")

    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --memory-budget: memory budget 0 is not a positive size; give a size such as 8GiB or 8GB"
    ]


def test_a_case_grows_by_its_batch_and_its_inputs_squared_so_a_text_encoder_by_its_batch_only(tiny):
    """Attention grows with tokens²: a UNet's with its pixels, a text encoder's (77 tokens, whatever the image size)
    not at all, so its larger cases are projected by their batch alone."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.stages.export import spec_for
    from sdtrt.tools.host_memory import HostMemory

    for component, grows_with_pixels in (("unet", True), ("text_encoder", False)):
        spec = spec_for(tiny, ExportConfig(component=component))
        profile = spec.default_profile()
        cases = spec.validation_cases(profile)
        smallest, largest = min(cases, key=lambda c: c.batch * c.height), max(cases, key=lambda c: c.batch * c.height)
        memory = HostMemory(spec, None)
        ratio = memory.size(largest) / memory.size(smallest)
        batch_ratio = largest.batch / smallest.batch
        pixel_ratio = (largest.height * largest.width) / (smallest.height * smallest.width)
        expected = batch_ratio * pixel_ratio**2 if grows_with_pixels else batch_ratio
        assert ratio == pytest.approx(expected, rel=0.05), (component, ratio, expected)


def test_a_case_whose_own_inputs_exceed_the_budget_is_not_compared_nor_allocated(tiny):
    """A case whose inputs alone are over the memory is listed, even before any case ran to project from: its
    inputs are sized from their shapes (batch 1,000,000 would have allocated 147 GB to find that out)."""
    from sdtrt.core.config import parse_size
    from sdtrt.spec import ValidationCase, denoiser_spec
    from sdtrt.tools.host_memory import HostMemory

    memory = HostMemory(denoiser_spec(tiny), parse_size("4GiB"))
    huge = ValidationCase(1_000_000, 384, 384)
    why = memory.refusal(huge)
    assert why is not None and why.startswith("not compared: its inputs alone take "), why
    assert "over the 4.00 GiB budget; raise --memory-budget" in why
    memory.measured = (1.0, "b1 128x128 t=500", 1)  # after a case ran, the same: sized, not drawn
    assert memory.refusal(huge) == why and memory.size(huge) > 0
    assert memory.refusal(ValidationCase(2, 256, 256)) is None  # a case of the default profile still fits
