"""Serving throughput on Triton Inference Server, dynamic batching on and off, next to in-process generate.

Compiles the model's engine set (ONNX Runtime target; a cache hit after the first run), deploys it
twice into one repository — ``batched`` (dynamic batching, max batch 4) and ``unbatched`` — starts
one tritonserver on 127.0.0.1, and sends the same requests (distinct prompts and seeds, one size,
one step count) at each concurrency. Prints images/s and p50/p95 latency per row, the in-process
``generate`` of the same requests one after another first. Warm-up requests are not timed.

    python benchmarks/triton_serving.py --model tiny --steps 10 --requests 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sdtrt.core.store import Store
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.serving.client import remote_image
from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton
from sdtrt.serving.serve import ServeConfig, free_ports, start_server
from sdtrt.sources.models import resolve_model
from sdtrt.tools.compile import compile_model


def summary(name: str, concurrency: int, latencies: list[float], wall_s: float) -> dict[str, float | str | int]:
    ordered = sorted(latencies)
    return {
        "mode": name,
        "concurrency": concurrency,
        "images_per_s": len(latencies) / wall_s,
        "p50_s": statistics.median(ordered),
        "p95_s": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
    }


def timed(
    call: Callable[[GenerateRequest], object], requests: list[GenerateRequest], concurrency: int
) -> tuple[list[float], float]:
    def one(request: GenerateRequest) -> float:
        started = time.perf_counter()
        call(request)
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(one, requests))
    return latencies, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=None, help="image height and width (default: the model's)")
    parser.add_argument("--requests", type=int, default=16, help="timed requests per row")
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--engines", default="engines")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()

    model = resolve_model(args.model)
    engine = compile_model(model, Store(args.engines), "onnxruntime").final
    requests = [
        GenerateRequest(f"request {i}", steps=args.steps, seed=i, height=args.size, width=args.size)
        for i in range(args.requests)
    ]
    rows = []
    pipe = load_pipeline(model, engine)
    generate(pipe, requests[0])  # warm-up
    rows.append(summary("in-process generate", 1, *timed(lambda r: generate(pipe, r), requests, 1)))
    with tempfile.TemporaryDirectory() as folder:
        repository = Path(folder) / "repository"
        for name, batching in (("batched", True), ("unbatched", False)):
            deploy_triton(engine, repository, TritonDeployConfig(name=name, dynamic_batching=batching), model)
        http, grpc, metrics = free_ports(3)
        config = ServeConfig(http_port=http, grpc_port=grpc, metrics_port=metrics)
        with (Path(folder) / "tritonserver.log").open("w") as log, start_server(repository, config, log):
            for name in ("batched", "unbatched"):
                remote_image(config.http_url, requests[0], name)  # warm-up
                for concurrency in (int(c) for c in args.concurrency.split(",")):
                    latencies, wall = timed(lambda r: remote_image(config.http_url, r, name), requests, concurrency)  # noqa: B023
                    rows.append(summary(f"triton {name}", concurrency, latencies, wall))

    print(f"{args.model}, {args.steps} steps, {args.requests} requests a row")
    print(f"{'mode':22s} {'concurrency':>11s} {'images/s':>9s} {'p50 s':>7s} {'p95 s':>7s}")
    for row in rows:
        print(
            f"{row['mode']:22s} {row['concurrency']:>11d} {row['images_per_s']:>9.2f} {row['p50_s']:>7.2f} "
            f"{row['p95_s']:>7.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
