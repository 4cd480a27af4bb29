"""Issue 38's scale checks: FLUX.2 [klein] 4B's transformer and its Qwen3-4B text encoder, and Qwen-Image's
Qwen2.5-VL-7B text encoder, exported by streaming within 8 GB peak and checked block by block (check-blocks).

Opt-in: pytest -m slow -s (prints times and peaks). Each export runs as ``sdtrt export`` in a child process, so its
peak RSS is its own. The graphs go to a temporary store and are deleted after each case; the presets (16-17 GB
each) stay in the models cache (sdtrt.sources.models.models_cache_dir) for the next run: delete them from there.
Qwen-Image's 20.4 B transformer (41 GB of weights, as much again for its graph) does not fit the disk of a 64 GB
machine: only its text encoder is written (qwen-image-random's partial preset; the transformer at full width and
2 of its 60 blocks: benchmarks/big_export.py). A case whose files do not fit the free disk is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdtrt.core.artifact import Artifact
from sdtrt.sources.models import ModelSource, models_cache_dir
from sdtrt.sources.preset_build import ensure_preset, preset_dir
from sdtrt.tools.block_parity import check_blocks

pytestmark = pytest.mark.slow

PEAK_LIMIT = 8 * 10**9  # bytes: issue 38's bound on a streamed export
GB = 10**9

# (preset, component, precision, networks written (all: ()), preset bytes, graph bytes). fp16 for klein's
# transformer; fp32 for klein's Qwen3, the precision ONNX Runtime on a CPU runs an LLM encoder in (no bf16 kernels;
# real checkpoints overflow fp16); the graphs hold only the layers the pipeline reads. Qwen2.5-VL's in fp16: its
# fp32 export writes 28 GB of folded (transposed) weights, then 28 GB of graph, beside 17 GB of preset, past a
# 64 GB disk; random weights do not overflow fp16.
CASES = [
    ("flux2-klein-random", "transformer", "fp16", (), 16.8 * GB, 7.8 * GB),
    ("flux2-klein-random", "text_encoder", "fp32", (), 16.8 * GB, 12.5 * GB),
    ("qwen-image-random", "text_encoder", "fp16", ("text_encoder",), 16.6 * GB, 14.1 * GB),
]
# The exporter's constant folding writes the transposed weights to a scratch file beside the graph while it is
# written: twice the graph's bytes at the peak.
SCRATCH_FACTOR = 2


def export_in_child(model: str, component: str, precision: str, engines: Path) -> tuple[Artifact, float, int]:
    """``sdtrt export`` in a child process: the artifact, wall seconds, the child's peak RSS in bytes."""
    command = [sys.executable, "-m", "sdtrt", "export", "--model", model, "--component", component,
               "--precision", precision, "--engines", str(engines)]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    printed = proc.stdout.read()
    proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)  # not proc.wait(): wait4 gives the child's peak RSS
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, printed
    return Artifact.open(Path(printed.strip().splitlines()[-1])), time.perf_counter() - started, usage.ru_maxrss * 1024


@pytest.mark.parametrize(("preset", "component", "precision", "networks", "preset_bytes", "graph_bytes"), CASES)
def test_streamed_export_within_8_gb_and_blocks_match(
    tmp_path, preset, component, precision, networks, preset_bytes, graph_bytes
):
    cache = models_cache_dir()
    built = any((preset_dir(preset, cache, n) / "model_index.json").is_file() for n in ((), networks))
    cache.mkdir(parents=True, exist_ok=True)
    needs = {tmp_path.stat().st_dev: SCRATCH_FACTOR * graph_bytes}  # by filesystem: the graph's, the preset's
    needs[cache.stat().st_dev] = needs.get(cache.stat().st_dev, 0) + (0 if built else preset_bytes)
    for where in {tmp_path, cache}:
        needed, free = needs[where.stat().st_dev], shutil.disk_usage(where).free
        if free < needed * 1.05:
            pytest.skip(f"{preset} {component} needs {needed / GB:.0f} GB of disk at {where}, {free / GB:.0f} GB free")
    started = time.perf_counter()
    model = ModelSource(preset, "preset", ensure_preset(preset, models_cache_dir(), networks))
    written = time.perf_counter() - started
    artifact, export_s, peak = export_in_child(str(model.path), component, precision, tmp_path)
    try:
        started = time.perf_counter()
        report = check_blocks(model, artifact)
        blocks_s = time.perf_counter() - started
    finally:
        shutil.rmtree(artifact.path)
    rows = ", ".join(f"{row['block']} cosine {min(o['cosine'] for o in row['outputs']):.6f}" for row in report.blocks)
    print(f"\n{preset} {component} {precision}: preset {written:.0f} s, export {export_s:.0f} s at peak "
          f"{peak / 2**30:.2f} GiB, check-blocks {blocks_s:.0f} s: {rows}")  # fmt: skip
    assert peak <= PEAK_LIMIT
    assert report, report.failures
    assert len(report.blocks) >= 2
