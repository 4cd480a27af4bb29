"""Builds a TensorRT engine from an ONNX file; run as a child process by the build stage.

    python -m sdtrt.trt_build_worker request.json

A crash or out-of-memory kill here cannot take the caller down with it: the parent turns a
non-zero exit into a BuildError that points at this process's log. Only documented TensorRT 10
Python API calls are used, with a strongly typed network (TensorRT 11 drops weak typing), and
every ``trt.`` name is checked against the published API in tests/test_tensorrt_api.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import tensorrt as trt


def build(request: dict[str, Any]) -> dict[str, Any]:
    logger = trt.Logger(trt.Logger.INFO)
    builder: trt.Builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network: trt.INetworkDefinition = builder.create_network(flags)
    parser: trt.OnnxParser = trt.OnnxParser(network, logger)
    # parse_from_file resolves external data (unet.onnx.data) relative to the model's folder.
    if not parser.parse_from_file(request["onnx"]):
        errors = [str(parser.get_error(i).desc()) for i in range(parser.num_errors)]
        raise RuntimeError("ONNX parser errors:\n" + "\n".join(errors))

    config: trt.IBuilderConfig = builder.create_builder_config()
    config.builder_optimization_level = request["optimization_level"]
    if request["workspace_bytes"]:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, request["workspace_bytes"])
    for shapes in request["profiles"]:
        profile: trt.IOptimizationProfile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)

    cache_path = Path(request["timing_cache"]) if request["timing_cache"] else None
    cache_bytes = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
    timing_cache: trt.ITimingCache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)

    started = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("builder.build_serialized_network returned None; see the TensorRT messages above")
    Path(request["plan"]).write_bytes(plan)
    if cache_path:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_bytes(config.get_timing_cache().serialize())
    return {"build_s": time.perf_counter() - started, "tensorrt": trt.__version__, "layers": network.num_layers}


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    result = build(request)
    Path(request["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
