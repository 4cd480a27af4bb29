"""Scale checks on the full SD 1.5 and SD 2.1 (768, v-prediction) UNet architectures, random weights.

Opt-in: pytest -m slow. SD 2.1 sets upcast_attention: its fp16 graph must keep softmax in fp32.
"""

from __future__ import annotations

import resource
import time

import pytest
from onnx import TensorProto

from sdtrt.config import ExportConfig, SimplifyConfig
from sdtrt.models import load_unet, resolve_model
from sdtrt.runtime import open_runtime
from sdtrt.stages import export, simplify
from sdtrt.store import Store
from sdtrt.validate import TensorCase, compare_unet

from .helpers import softmax_input_types

pytestmark = pytest.mark.slow


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


@pytest.mark.parametrize(("preset", "size", "batch"), [("sd15-random", 512, 2), ("sd21-random", 768, 1)])
def test_fp16_export_simplify_and_parity(tmp_path, preset, size, batch):
    timings = {}
    started = time.perf_counter()
    model = resolve_model(preset)
    timings["preset"] = time.perf_counter() - started
    store = Store(tmp_path)

    started = time.perf_counter()
    exported = export.run(ExportConfig(precision="fp16"), model, store)
    timings["export"] = time.perf_counter() - started
    started = time.perf_counter()
    simplified = simplify.run(SimplifyConfig(), exported, store)
    timings["simplify"] = time.perf_counter() - started

    details = simplified.manifest["details"]
    assert details["nodes_after"] < details["nodes_before"]

    started = time.perf_counter()
    runtime = open_runtime(simplified)
    stats = compare_unet(runtime, load_unet(model), runtime.spec, TensorCase(batch, size, size))
    timings["parity"] = time.perf_counter() - started
    print(
        f"\n{preset} fp16, batch {batch} at {size}²: {', '.join(f'{k} {v:.1f} s' for k, v in timings.items())}; "
        f"nodes {details['nodes_before']} -> {details['nodes_after']} ({details['method']}); "
        f"max abs {stats['max_abs']:.3g}, cosine {stats['cosine']:.6f}; peak RSS {peak_rss_gb():.1f} GB"
    )
    assert stats["finite"] and stats["cosine"] >= 0.999
    upcast = model.unet_config().get("upcast_attention", False)
    assert softmax_input_types(simplified.primary) == {TensorProto.FLOAT if upcast else TensorProto.FLOAT16}
