"""The findings of a newcomer's trial from a fresh clone: CLI messages, options and output, each as the user met it."""

from __future__ import annotations

import pytest

from sdtrt.store import Artifact
from tests.helpers import last_line, run_cli


def one_line_usage_error(result) -> str:
    """The one stderr line of a usage error (exit 2)."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("command", ["quantize", "compile"])
def test_a_malformed_level_is_one_line_naming_the_levels(command):
    stderr = one_line_usage_error(run_cli(command, "--level", "abc"))
    assert "'abc'" in stderr and "2.5: convolutions, feed-forward and Q/K/V projections" in stderr


ENGINE_COMMANDS = {
    "generate": ["generate", "--engine"],
    "validate": ["validate", "--engine"],
    "check-blocks": ["check-blocks", "--engine"],
    "profile": ["profile", "--out", "unused", "--engine"],
    "deploy triton": ["deploy", "triton", "--out", "unused", "--engine"],
    "lora inspect": ["lora", "inspect", "README.md", "--engine"],
    "debug": ["debug"],
}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_an_engine_that_names_no_artifact_is_a_usage_error(command, tmp_path):
    """A path that does not exist, or a folder that is no artifact, is a usage error saying what to pass instead."""
    missing = one_line_usage_error(run_cli(*ENGINE_COMMANDS[command], str(tmp_path / "no-such-engine")))
    assert "does not exist" in missing and "pass the directory a stage printed" in missing
    if command in ("validate", "debug"):  # an option and an argument
        not_artifact = one_line_usage_error(run_cli(*ENGINE_COMMANDS[command], str(tmp_path)))
        assert "is not an sdtrt artifact" in not_artifact


def test_sizes_show_in_the_units_given():
    """1MB is 10^6 bytes and shows as 1.0 MB, 1MiB as 1.0 MiB; measured sizes show in binary units."""
    from sdtrt.config import format_size, parse_size
    from sdtrt.stages.simplify import choose_method

    given = {"1MB": "1.0 MB", "1mib": "1.0 MiB", "8GB": "8.00 GB", "8GiB": "8.00 GiB", "512MB": "512.0 MB",
             "100KB": "100.0 kB", "1TB": "1.00 TB", "0.5TiB": "512.00 GiB"}  # fmt: skip
    assert {text: format_size(parse_size(text)) for text in given} == given
    assert (parse_size("1MB"), parse_size("1MiB"), parse_size("1TiB")) == (10**6, 2**20, 2**40)
    assert format_size(1_719_664_640) == "1.60 GiB"  # a measured size
    _, reason = choose_method("auto", 3 * 10**6, parse_size("1MB"))
    assert "over the memory budget (1.0 MB)" in reason


def test_compile_takes_the_memory_budget_and_weights_options(tmp_path):
    """compile passes --weights to its exports and --memory-budget (or SDTRT_MEMORY_BUDGET) to its simplify steps,
    as export and simplify take them; a malformed budget is a usage error before anything loads."""
    malformed = one_line_usage_error(run_cli("compile", "--memory-budget", "lots"))
    assert "--memory-budget: 'lots' is not a size" in malformed
    result = run_cli(
        "compile", "--target", "onnxruntime", "--components", "text_encoder", "--no-validate", "--weights", "stream",
        "--engines", str(tmp_path), env={"SDTRT_MEMORY_BUDGET": "100KB"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    built = Artifact.open(last_line(result.stdout))
    simplified, exported = built.lineage()[1:3]
    assert exported.manifest["details"]["weights"] == "stream"
    details = simplified.manifest["details"]
    assert details["method"] == "stream" and "over the memory budget (100.0 kB)" in details["method_reason"]
    assert details["memory_budget"] == 100_000
