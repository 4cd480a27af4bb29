"""Scale check on SDXL base's architecture (2.6 B-parameter UNet, random weights). Opt-in: pytest -m slow.

Issue 11 asks that fp16 export + simplify of this UNet fit a 2-core / 24 GB machine (≤ 20 GB peak).
"""

from __future__ import annotations

import resource
import time

import pytest

from sdtrt.config import ExportConfig, SimplifyConfig
from sdtrt.models import resolve_model
from sdtrt.stages import export, simplify
from sdtrt.store import Store

pytestmark = pytest.mark.slow


def test_sdxl_fp16_unet_export_and_simplify_fit_in_20_gb(tmp_path):
    timings = {}
    started = time.perf_counter()
    model = resolve_model("sdxl-random")
    timings["preset"] = time.perf_counter() - started
    store = Store(tmp_path)
    started = time.perf_counter()
    exported = export.run(ExportConfig(precision="fp16"), model, store)
    timings["export"] = time.perf_counter() - started
    started = time.perf_counter()
    simplified = simplify.run(SimplifyConfig(), exported, store)
    timings["simplify"] = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    details = simplified.manifest["details"]
    print(
        f"\nsdxl-random fp16 UNet: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}; "
        f"nodes {details['nodes_before']} -> {details['nodes_after']} ({details['method']}); peak RSS {peak_gb:.1f} GB"
    )
    assert exported.manifest["family"] == "sdxl" and exported.manifest["details"]["external_data"]
    assert peak_gb <= 20.0
