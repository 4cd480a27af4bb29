"""The whole pipeline on engines, on the CPU: compile an engine set, then its image against PyTorch fp32.

Prints the compile wall time and peak RSS, each component's export / simplify / build time (from the
manifests, so cache hits show the times of the run that built them), and the PSNR of the image the
pipeline makes with every engine swapped in against the PyTorch fp32 pipeline's (same prompt, seed).

    python benchmarks/engine_set_cpu.py --model tiny
    python benchmarks/engine_set_cpu.py --model sd15-random --steps 2 --size 512

For per-call latency of each component, engine vs PyTorch, run `sdtrt bench` on the same model.
"""

from __future__ import annotations

import argparse
import resource
import time

from sdtrt.core.config import ExportConfig
from sdtrt.core.store import Store
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.sources.models import resolve_model
from sdtrt.stages.engine_set import members
from sdtrt.tools.compile import compile_model
from sdtrt.tools.validate import psnr_db


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "fp32"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=None, help="image height and width (default: the model's)")
    parser.add_argument("--engines", default="engines")
    args = parser.parse_args()

    model = resolve_model(args.model)
    store = Store(args.engines)
    started = time.perf_counter()
    result = compile_model(model, store, "onnxruntime", ExportConfig(precision=args.precision))
    compile_s = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"compile ({args.model}, {args.precision}): {compile_s:.1f} s wall, peak RSS {peak_gb:.1f} GB")
    for component, built in members(result.final).items():
        parts = {a.stage: a.manifest["timings"].get("stage_s", 0.0) for a in reversed(built.lineage())}
        precision = built.manifest["io"]["precision"]
        print(f"  {component:13s} {precision}: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))

    request = GenerateRequest(
        prompt="a lighthouse at dusk", steps=args.steps, seed=0, height=args.size, width=args.size
    )
    images = []
    for engine in (None, result):
        pipe = load_pipeline(model, engine)
        started = time.perf_counter()
        images.append(generate(pipe, request, output_type="np").images[0])
        print(f"{'engine set' if engine else 'PyTorch fp32'}: one image in {time.perf_counter() - started:.1f} s")
    print(f"image PSNR, every engine swapped in vs PyTorch fp32: {psnr_db(images[1], images[0]):.1f} dB")


if __name__ == "__main__":
    main()
