"""Build stage, ONNX Runtime target: apply graph optimizations once and save the optimized graph.

Loading the saved graph with optimizations disabled skips that work at every session start. The
shape profile is recorded so the runtime refuses requests the artifact was not built for.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import OrtBuildConfig
from ..core.progress import step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..graph import onnx_graph
from ..runtime.compare import compare_graphs
from ..runtime.onnxruntime import session_options

STAGE = "build-ort"
VERSION = 1
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def run(config: OrtBuildConfig, source: Artifact, store: Store) -> Artifact:
    spec = onnx_graph.artifact_spec(source)
    spec.check_profile(config.profile)
    request = StageRequest(STAGE, VERSION, config, [source.as_input()], environment("onnxruntime"))
    artifact, _ = store.produce(request, lambda out_dir: _build(config, source, out_dir))
    return artifact


def _build(config: OrtBuildConfig, source: Artifact, out_dir: Path) -> dict[str, Any]:
    import onnxruntime as ort

    spec = onnx_graph.artifact_spec(source)
    out_path = out_dir / f"{spec.component}.ort.onnx"
    options = session_options()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[config.optimization]
    options.optimized_model_filepath = str(out_path)
    weight_bytes = onnx_graph.weights_on_disk(source.primary.parent)
    if weight_bytes > onnx_graph.EXTERNAL_DATA_THRESHOLD:
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", onnx_graph.data_file(out_path).name
        )
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    started = time.perf_counter()
    with step(f"Optimizing the graph for ONNX Runtime ({config.optimization}, {config.provider})"):
        ort.InferenceSession(str(source.primary), options, providers=[PROVIDERS[config.provider]])
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    with step("Checking the optimized graph against its input"):
        check = compare_graphs(source.primary, out_path, spec)
    before, after = onnx_graph.op_counts(source.primary), onnx_graph.op_counts(out_path)
    return {
        "primary": out_path.name,
        "io": spec.to_json(),
        "profile": config.profile.to_json(),
        "target": "onnxruntime",
        "timings": {"build_s": round(build_s, 3), "check_s": round(time.perf_counter() - started, 3)},
        "details": {
            "provider": PROVIDERS[config.provider],
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "check": check,
        },
        "reproduce": f"sdtrt build {source.path} --target onnxruntime --optimization {config.optimization}",
    }
