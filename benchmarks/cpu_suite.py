"""The CPU benchmark suite behind README's Results: tiny and sd15-random, side by side per model.

    python benchmarks/cpu_suite.py                 # everything (~30 min on 2 cores, ~11 GB RAM)
    python benchmarks/cpu_suite.py --models tiny   # a minute or two

For each model it runs, in separate processes so one model's memory does not weigh on the other:
1. UNet only, batch 2 (one image with classifier-free guidance): PyTorch eager fp32 vs ONNX
   Runtime with the fp32 and the fp16 graph (benchmarks/unet_cpu.py);
2. a short full pipeline with `sdtrt bench`: PyTorch, PyTorch without SDPA, ONNX Runtime with the
   fp32 and the fp16 engine, in one run, with the stage breakdown and a chart.
Results (JSON and PNG) go to --out; the ratios are printed at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BACKENDS = "torch,torch-sdpa-off,onnxruntime:fp32,onnxruntime:fp16"
SETTINGS = {
    "tiny": {"size": 256, "steps": 10, "repeats": 5, "unet_repeats": 20},
    "sd15-random": {"size": 512, "steps": 2, "repeats": 2, "unet_repeats": 3},
}


def run(args: list[str]) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,sd15-random")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--engines", default="engines")
    parser.add_argument("--parts", default="unet,pipeline", help="unet, pipeline, or both")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for model in args.models.split(","):
        s = SETTINGS[model]
        size = str(s["size"])
        unet_json = args.out / f"unet-{model}.json"
        if "unet" in args.parts:
            run([sys.executable, str(HERE / "unet_cpu.py"), "--model", model, "--height", size, "--width", size,
                 "--repeats", str(s["unet_repeats"]), "--engines", args.engines, "--json", str(unet_json)])  # fmt: skip
        stem = args.out / f"pipeline-{model}"
        if "pipeline" in args.parts:
            run([sys.executable, "-m", "sdtrt", "bench", "--model", model, "--backends", BACKENDS,
                 "--steps", str(s["steps"]), "--height", size, "--width", size, "--warmup", "1",
                 "--repeats", str(s["repeats"]), "--engines", args.engines,
                 "--json", f"{stem}.json", "--chart", f"{stem}.png"])  # fmt: skip
        unet = json.loads(unet_json.read_text())
        summary += [f"{model} UNet ({size}px, batch 2): {r['backend']} {r['call_s']['median']:.3f} s/call, "
                    f"{r['speedup_vs_torch']:.2f}x vs torch" for r in unet["results"]]  # fmt: skip
        bench = json.loads((args.out / f"pipeline-{model}.json").read_text())
        summary += [f"{model} pipeline ({s['steps']} steps, {size}px): {b['name']} {b['total_s']['median']:.2f} s, "
                    f"{b['speedup_vs_first']:.2f}x vs torch"
                    for b in bench["backends"] if b["status"] == "ok"]  # fmt: skip
    print("\n".join(summary))
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
