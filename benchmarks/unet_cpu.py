"""UNet latency per call on the CPU: PyTorch eager fp32 vs ONNX Runtime (fp32 and fp16 graphs).

Side by side in one run, same inputs, warm-up excluded. Prints a table with ratios against PyTorch
eager and writes JSON. Engines come from the store (built on first use, cache hits afterwards).

    python benchmarks/unet_cpu.py --model tiny --repeats 10
    python benchmarks/unet_cpu.py --model sd15-random --height 512 --width 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from sdtrt.core.config import ExportConfig, Range, ShapeProfile
from sdtrt.core.store import Store
from sdtrt.runtime import open_runtime
from sdtrt.runtime.torch import TorchRuntime
from sdtrt.sources.models import load_unet, resolve_model
from sdtrt.stages.export import spec_for
from sdtrt.tools.compile import compile_model
from sdtrt.tools.timing import time_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with CFG)")
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default="engines")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model, store = resolve_model(args.model), Store(args.engines)
    spec = spec_for(model, ExportConfig(precision="fp32"))
    images = max(1, args.batch // 2)
    profile = ShapeProfile(Range(1, images, max(images, 4)), Range(args.height, args.height, args.height),
                           Range(args.width, args.width, args.width))  # fmt: skip
    feeds = spec.sample_inputs(args.batch, args.height, args.width, seed=0)

    backends = [("torch eager fp32", None)]
    for precision in ("fp32", "fp16"):
        engine = compile_model(model, store, "onnxruntime", ExportConfig(precision=precision), profile=profile).final
        backends.append((f"onnxruntime {precision}", engine))

    rows = []
    for name, engine in backends:
        started = time.perf_counter()
        runtime = TorchRuntime(load_unet(model), spec) if engine is None else open_runtime(engine, model)
        load_s = time.perf_counter() - started
        typed = {
            k: v.to(runtime.dtype) if v.is_floating_point() and k != spec.input_names[1] else v
            for k, v in feeds.items()
        }
        stats = time_calls(lambda runtime=runtime, typed=typed: runtime.run(typed), args.warmup, args.repeats)
        rows.append({"backend": name, "load_s": load_s, "call_s": stats.to_json(), "spread": stats.spread})
        runtime.close()
        del runtime

    base = rows[0]["call_s"]["median"]
    print(f"\nUNet per call, {args.model}, batch {args.batch}, {args.height}x{args.width}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} (warm-up {args.warmup})")  # fmt: skip
    print(f"{'backend':20s} {'load s':>8s} {'median s':>10s} {'min s':>8s} {'max s':>8s} {'vs torch':>9s}")
    for row in rows:
        call = row["call_s"]
        row["speedup_vs_torch"] = base / call["median"]
        print(f"{row['backend']:20s} {row['load_s']:8.2f} {call['median']:10.4f} {call['min']:8.4f} "
              f"{call['max']:8.4f} {row['speedup_vs_torch']:8.2f}x")  # fmt: skip
    if args.json:
        env = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor()}
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)}, "environment": env,
                                         "results": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
