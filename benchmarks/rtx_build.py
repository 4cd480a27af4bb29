"""What a TensorRT-RTX plan costs to build on this (CPU) machine, beside the ONNX Runtime graph, for one model's UNet.

The denoiser is exported (fp16 unless --precision) and simplified as compile does them (cache hits when --engines has
them), then built twice with compile's `build`, each build in its own child process (benchmarks/big_export.py's
`child`): (a) the ONNX Runtime target (stages/build_ort: graph optimizations applied and saved, then the saved graph
checked against its input on ONNX Runtime), (b) the TensorRT-RTX target (stages/build_trt, product tensorrt-rtx: an
ahead-of-time plan for TensorRT-RTX's default compute capabilities, built by its worker process). Prints both side by
side (wall time, peak RSS, output size, the ratio RTX/ORT) with the plan's layer summary, then JSON.

    python benchmarks/rtx_build.py                                   # sd15-random
    python benchmarks/rtx_build.py --model sdxl-random --json rtx-sdxl.json

Peak RSS is ru_maxrss from wait4: the child's own, or its build worker's when larger (the largest one process, not a
sum). The builds go to a fresh temporary store, removed at the end, so each is measured and none is a cache hit; the
export and the simplified graph stay in --engines (default: /tmp/rtxbench-store), presets in --models ($SDTRT_MODELS).
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from big_export import child, ran_as_child  # this folder is sys.path[0] when the script runs

STEPS = ("export", "simplify", "onnxruntime", "tensorrt-rtx")
BUILDS = ("onnxruntime", "tensorrt-rtx")


def run_step(step: str, args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """One step, in this (child) process; returns what later steps need and what to report."""
    from sdtrt.core.artifact import Artifact
    from sdtrt.core.store import Store
    from sdtrt.sources.models import resolve_model

    if step == "export":
        from sdtrt.core.config import ExportConfig
        from sdtrt.stages import export

        model = resolve_model(args.model)
        config = ExportConfig(precision=args.precision, component=model.denoiser_folder)  # type: ignore[arg-type]
        store = Store(args.engines)
        artifact = export.run(config, model, store)
        cached = artifact.path in store.reused
        return {"export": str(artifact.path), "component": model.denoiser_folder, "cached": cached}
    if step == "simplify":
        from sdtrt.core.config import SimplifyConfig
        from sdtrt.stages import simplify

        store = Store(args.engines)
        artifact = simplify.run(SimplifyConfig(), Artifact.open(state["export"]), store)
        return {"simplify": str(artifact.path), "method": artifact.manifest["details"]["method"],
                "cached": artifact.path in store.reused}  # fmt: skip
    from sdtrt.tools.compile import build

    artifact, _ = build(Artifact.open(state["simplify"]), Store(state["builds"]), step)  # type: ignore[arg-type]
    manifest = artifact.manifest
    outputs = [f for f in manifest["files"] if not f["name"].endswith((".json", ".log"))]  # not request.json, build.log
    return {
        "output": [f["name"] for f in outputs],
        "output_bytes": sum(f["size"] for f in outputs),
        "timings": manifest["timings"],  # the stage's own: build_s (and check_s for ONNX Runtime)
        "details": {k: manifest["details"][k] for k in ("layers", "parameters", "compute_capabilities", "tensorrt-rtx",
                                                        "nodes_before", "nodes_after") if k in manifest["details"]},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd15-random", help="sd15-random (default), sdxl-random, any UNet preset")
    parser.add_argument("--precision", default="fp16", help="the export's (default fp16)")
    parser.add_argument("--engines", default=str(Path(tempfile.gettempdir()) / "rtxbench-store"), help="export store")
    parser.add_argument("--models", default=os.environ.get("SDTRT_MODELS"), help="presets cache")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if ran_as_child(args, run_step):
        return

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rtxbench-builds-") as builds:
        state: dict[str, Any] = {"builds": builds}
        for step in STEPS:
            print(f"== {step}", file=sys.stderr, flush=True)
            rows[step] = child(step, sys.argv[1:], state, __file__)
            if step not in BUILDS:
                if rows[step]["exit"] != 0:
                    break  # nothing to build
                state |= rows[step]["result"]
    report(args, state, rows)


def report(args: argparse.Namespace, state: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    def gib(row: dict[str, Any]) -> float:
        return row["peak_rss_bytes"] / 2**30

    for step in STEPS[:2]:
        if row := rows.get(step):
            said = row.get("error") or ("cached" if row["result"]["cached"] else row["result"][step])
            print(f"{step:<9} {row['wall_s']:>7.1f} s  peak RSS {gib(row):5.2f} GiB  {said}")
    built = {step: rows[step] for step in BUILDS if step in rows}
    ort, rtx = (built.get(step, {}).get("result") for step in BUILDS)
    details = (rtx or ort or {}).get("details", {})
    print(f"\n{args.model} {state.get('component')}, {args.precision} ({details.get('parameters', 0) / 1e6:.1f} M "
          f"parameters), graph simplified by {state.get('method')}")  # fmt: skip
    print(f"{'':<24} {'onnxruntime':>13} {'tensorrt-rtx':>13} {'RTX/ORT':>8}")
    lines: list[tuple[str, Any]] = [
        ("build wall s", lambda row: row["wall_s"]),
        ("  stage's own build s", lambda row: row["result"]["timings"]["build_s"]),
        ("peak RSS GiB", gib),
        ("output GB", lambda row: row["result"]["output_bytes"] / 1e9),
    ]
    for label, value in lines:
        cells = [value(built[step]) if built.get(step, {}).get("exit") == 0 else None for step in BUILDS]
        ratio = f"{cells[1] / cells[0]:.2f}" if None not in cells and cells[0] else "-"
        shown = " ".join(f"{c:>13.2f}" if c is not None else f"{'-':>13}" for c in cells)
        print(f"{label:<24} {shown} {ratio:>8}")
    if ort:
        timings, ort_details = ort["timings"], ort["details"]
        print(f"ONNX Runtime: {', '.join(ort['output'])}; check {timings.get('check_s', 0):.1f} s on ONNX Runtime; "
              f"{ort_details['nodes_before']} → {ort_details['nodes_after']} nodes")  # fmt: skip
    if rtx:
        plan = rtx["details"]
        print(f"TensorRT-RTX {plan.get('tensorrt-rtx')}: {', '.join(rtx['output'])}; {plan['layers']}; "
              f"compute capabilities: {plan.get('compute_capabilities')}")  # fmt: skip
    for step, row in built.items():
        if row["exit"] != 0:
            print(f"{step}: {row['error']}")
    summary = {"model": args.model, "precision": args.precision, "component": state.get("component"),
               "simplify_method": state.get("method"), "steps": rows}  # fmt: skip
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
