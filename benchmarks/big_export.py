"""Memory and time of the export chain on a big network: preset → export → simplify → weight map → block parity.

Each step runs in its own child process, so its peak RSS (the child's ru_maxrss, from wait4) is its own; each
uses the public stage function with its default config (the component's default precision and exporter), so
what the stages do to stream weights shows here unchanged. Prints a table and JSON: wall time, peak RSS and
peak / weight bytes (the component's parameters at the exported graph's precision) per step.

    python benchmarks/big_export.py --model flux-random
    python benchmarks/big_export.py --model sd35-large-random --json big-sd35.json
    python benchmarks/big_export.py --model sdxl-random --component unet --exporter dynamo
    python benchmarks/big_export.py --model tiny-flux --engines /tmp/big/engines --models /tmp/big/models
    python benchmarks/big_export.py --model sd15-random --compare-weights   # loaded and streamed, side by side
    python benchmarks/big_export.py --model tiny-flux --blocks 19,38 --compare-stamp   # Flux's depth at tiny width:
        # today's export (every block traced, onnxscript's optimizer search) and the stamped one, side by side
    python benchmarks/big_export.py --model tiny-flux --blocks 19,38 38,76 --baseline /tmp/sdtrt-33de05c
        # export time against block count: torch.export, the optimizer and the whole export, wall and CPU seconds,
        # per size, for this tree and an sdtrt source tree of another commit, alternating (the tree:
        # mkdir /tmp/sdtrt-33de05c && git archive 33de05c sdtrt | tar -x -C /tmp/sdtrt-33de05c)
    python benchmarks/big_export.py --model flux2-klein-random --component text_encoder --precision fp32 \
        --steps preset,export,blocks   # klein's Qwen3-4B: fp32, the LLM graph ONNX Runtime runs on a CPU
    python benchmarks/big_export.py --model qwen-image-random --only text_encoder --component text_encoder \
        --precision fp16 --steps preset,export,blocks   # Qwen2.5-VL-7B alone: the whole preset does not fit 64 GB;
        # fp16, as fp32's export writes 28 GB of folded-weight scratch, then 28 GB of graph, beside the 17 GB preset
    python benchmarks/big_export.py --model qwen-image-random --only vae --blocks num_layers=2 \
        --steps preset,export,blocks   # Qwen-Image's transformer at full width, 2 of its 60 blocks (in bf16, the
        # preset's dtype; num_layers=40: 13.6 B parameters, 27 GB, two thirds of its depth)

Artifacts go to --engines (default $SDTRT_ENGINES or ./engines), presets to --models ($SDTRT_MODELS); a step whose
artifact is there already is a cache hit (delete them to measure again). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

STEPS = ("preset", "export", "simplify", "weight-map", "blocks")
NEEDS = {"export": "preset", "simplify": "export", "weight-map": "simplify", "blocks": "export"}


def run_step(step: str, args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    """One step, in this (child) process; returns what later steps need and what to report."""
    from sdtrt.core.artifact import Artifact
    from sdtrt.core.store import Store
    from sdtrt.sources.models import resolve_model

    model = preset_part(args.model, args.only.split(",")) if args.only else resolve_model(args.model)
    component = args.component or model.denoiser_folder
    if args.blocks:
        model = with_blocks(model, component, args.blocks[-1].split(","), preset_dtype(args.model))
    store = Store(Path(args.engines))
    if step == "preset":
        from sdtrt.spec import FOLDERS
        from sdtrt.tools.block_parity.stored import stored_tensors

        tensors = stored_tensors(model.component_dir(FOLDERS[component]))
        return {"model": str(model.path), "component": component, "parameters": sum(t.numel for t in tensors.values())}
    if step == "export":
        from sdtrt.core.config import ExportConfig
        from sdtrt.stages import export

        options = (("precision", args.precision), ("exporter", args.exporter), ("weights", args.weights))
        overrides = {k: v for k, v in options if v}
        if args.stamp == "off":
            todays_export(export.spec_for(model, ExportConfig(component=component)))
        phases: dict[str, float] = {}
        with timed_phases(phases):
            artifact = export.run(ExportConfig(component=component, **overrides), model, store)  # type: ignore[arg-type]
        details = artifact.manifest["details"]
        return {"export": str(artifact.path), "precision": artifact.manifest["io"]["precision"],
                "exporter": details["exporter"], "weights": details["weights"], "phases": phases}  # fmt: skip
    if step == "simplify":
        from sdtrt.core.config import SimplifyConfig, parse_size
        from sdtrt.stages import simplify

        budget = parse_size(args.memory_budget) if args.memory_budget else None
        artifact = simplify.run(SimplifyConfig(memory_budget=budget), Artifact.open(state["export"]), store)
        return {"simplify": str(artifact.path), "method": artifact.manifest["details"]["method"]}
    if step == "weight-map":
        from sdtrt.stages import weight_map

        mapped = weight_map.for_engine(Artifact.open(state["simplify"]), model, component)
        return {"mapped": len(mapped.mapped), "unmapped": len(mapped.unmapped)}
    from sdtrt.tools.block_parity import check_blocks

    report = check_blocks(model, Artifact.open(state["export"]))
    return {"blocks": [row["block"] for row in report.blocks], "passed": bool(report), "failures": report.failures}


def preset_part(name: str, networks: list[str]) -> Any:
    """A streamed preset with only ``networks``' weights written (preset_build.ensure_preset's ``networks``)."""
    from sdtrt.sources.models import ModelSource, models_cache_dir
    from sdtrt.sources.preset_build import ensure_preset

    return ModelSource(name, "preset", ensure_preset(name, models_cache_dir(), networks))


def preset_dtype(name: str) -> str:
    """The dtype a preset's networks are written in (a bf16 preset's grown network too); fp32 for a folder."""
    from sdtrt.sources.presets import PRESETS

    return PRESETS[name].dtype if name in PRESETS else "float32"


def with_blocks(model: Any, component: str, counts: list[str], dtype: str) -> Any:
    """The model with its component's repeated block lists (its spec's repeated_blocks, in order) ``counts`` long,
    or with the config values ``counts`` names (``num_layers=2``: a network whose spec stamps no blocks), random
    weights keyed by name (preset_build.with_network_config) in ``dtype``, built once beside the presets."""
    from sdtrt.core.config import ExportConfig
    from sdtrt.sources.models import resolve_model
    from sdtrt.sources.preset_build import with_network_config
    from sdtrt.spec import FOLDERS
    from sdtrt.stages import export

    if all("=" in count for count in counts):
        overrides = {key: int(n) for key, n in (count.split("=") for count in counts)}
    else:
        keys = list(type(export.spec_for(model, ExportConfig(component=component))).repeated_blocks.values())
        if len(keys) != len(counts) or not keys:
            raise SystemExit(f"--blocks takes {len(keys)} counts for this {component} ({', '.join(keys)}), or KEY=N")
        overrides = dict(zip(keys, map(int, counts), strict=True))
    grown = "-".join(f"{k}-{n}" for k, n in overrides.items())
    dest = model.path.parent / f"{model.path.name}-blocks-{grown}-{dtype}"
    with_network_config(model.path, FOLDERS[component], dest, dtype=dtype, **overrides)
    return resolve_model(str(dest))


def todays_export(spec: Any) -> None:
    """Export as before stamping: every block traced (the spec names no repeated lists) and onnxscript's own
    multi-output pattern search, for side-by-side timings. It patches the spec's class and a module global for good:
    only in a child process that exports once."""
    import contextlib

    from sdtrt.stages import exporters

    type(spec).repeated_blocks = {}
    exporters.multi_output_matches_by_use = contextlib.nullcontext  # type: ignore[assignment]


@contextlib.contextmanager
def timed_phases(into: dict[str, float]) -> Iterator[None]:
    """Wall and CPU seconds (this process's, all threads) of torch.export and of the exporter's optimizer
    (``ONNXProgram.optimize``, inside any hook the export puts around it), summed into ``into``."""
    import torch.export
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    def timed(owner: Any, name: str, phase: str) -> Any:
        original = getattr(owner, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                into[f"{phase}_s"] = round(into.get(f"{phase}_s", 0) + time.perf_counter() - wall, 1)
                into[f"{phase}_cpu_s"] = round(into.get(f"{phase}_cpu_s", 0) + time.process_time() - cpu, 1)

        setattr(owner, name, run)
        return original

    originals = [(torch.export, "export", timed(torch.export, "export", "torch_export")),
                 (ONNXProgram, "optimize", timed(ONNXProgram, "optimize", "optimizer"))]  # fmt: skip
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def child(
    step: str, argv: list[str], state: dict[str, Any], script: str = __file__, source: str | None = None
) -> dict[str, Any]:
    """Run ``step`` in a child process (``script``, which must take --child STEP --state FILE and write its result to
    FILE, as this one does), importing sdtrt from ``source`` if given: its wall and CPU time, peak RSS and result.
    The peak is ru_maxrss from wait4: that child's, or its largest waited-for descendant's (a build worker's) when
    larger."""
    env = os.environ | ({"PYTHONPATH": source} if source else {})
    with tempfile.TemporaryDirectory() as tmp:
        state_file = Path(tmp) / "state.json"
        state_file.write_text(json.dumps(state))
        started = time.perf_counter()
        proc = subprocess.Popen([sys.executable, script, *argv, "--child", step, "--state", str(state_file)], env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        result = json.loads(state_file.read_text()) if code == 0 else {}
    cpu = round(usage.ru_utime + usage.ru_stime, 1)
    out = {"step": step, "wall_s": round(wall, 1), "cpu_s": cpu, "peak_rss_bytes": usage.ru_maxrss * 1024, "exit": code}
    return out | ({"result": result} if code == 0 else {"error": f"exited {code} (its stderr above says why)"})


def ran_as_child(args: argparse.Namespace, run_step: Callable[..., dict[str, Any]]) -> bool:
    """Set the presets cache; in a child (--child STEP --state FILE), run that step on the state file and say so."""
    if args.models:
        os.environ["SDTRT_MODELS"] = args.models
    if not args.child:
        return False
    state_file = Path(args.state)
    state_file.write_text(json.dumps(run_step(args.child, args, json.loads(state_file.read_text()))))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="flux-random, sd35-large-random, sdxl-random, any preset")
    parser.add_argument("--component", default=None, help="default: the model's denoiser")
    parser.add_argument("--precision", default=None, help="default: ExportConfig's")
    parser.add_argument("--exporter", default=None, help="default: ExportConfig's (auto)")
    parser.add_argument("--weights", default=None, choices=("auto", "load", "stream"), help="default: ExportConfig's")
    compare = parser.add_mutually_exclusive_group()  # each is its own plan of exports
    compare.add_argument(
        "--compare-weights", action="store_true",
        help="export and simplify twice, --weights load then stream, each into its own store under --engines "
        "(weights-load/, weights-stream/: the key does not hold the weights path), side by side",
    )  # fmt: skip
    parser.add_argument(
        "--blocks", nargs="+", default=None,
        help="the component's repeated block counts, e.g. 19,38 for Flux, or config values: num_layers=2; "
        "several sizes (19,38 38,76): export each",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default=None,
        help="with --blocks: an sdtrt source tree (another commit's, git archive) to export each size with too",
    )  # fmt: skip
    parser.add_argument("--only", default=None, help="write only these networks of a streamed preset: text_encoder")
    parser.add_argument("--steps", default=None, help=f"which steps, of {','.join(STEPS)} (default: all)")
    compare.add_argument(
        "--compare-stamp", action="store_true",
        help="export twice, as before stamping (--stamp off) then stamped, each into its own store under --engines",
    )  # fmt: skip
    parser.add_argument("--stamp", default="on", choices=("on", "off"), help="off: as before stamping")
    parser.add_argument("--engines", default=os.environ.get("SDTRT_ENGINES", "engines"))
    parser.add_argument("--models", default=os.environ.get("SDTRT_MODELS"), help="presets cache")
    parser.add_argument("--memory-budget", default=None, help="simplify's (8GiB): over it the ORT check is skipped")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if ran_as_child(args, run_step):
        return

    steps = args.steps.split(",") if args.steps else list(STEPS)
    if unknown := [step for step in steps if step not in STEPS]:
        parser.error(f"--steps: {', '.join(unknown)} unknown; the steps are {','.join(STEPS)}")
    if args.steps and (args.compare_weights or args.compare_stamp):
        parser.error("--steps does not apply to --compare-weights or --compare-stamp, which run their own steps")
    # (step, label, extra child arguments): each step once, or export and simplify once per weights path.
    plan: list[tuple[str, str, list[str]]] = [(step, "", []) for step in STEPS if step in steps]
    if args.compare_weights:
        plan = [("preset", "", [])] + [
            (step, f" ({weights})", ["--weights", weights, "--engines", str(Path(args.engines) / f"weights-{weights}")])
            for weights in ("load", "stream")
            for step in ("export", "simplify")
        ]
    if args.compare_stamp:
        plan = [("preset", "", [])] + [
            ("export", f" (stamp {stamp})", ["--stamp", stamp, "--engines", str(Path(args.engines) / f"stamp-{stamp}")])
            for stamp in ("off", "on")
        ]
    if args.blocks and (len(args.blocks) > 1 or args.baseline):
        sides = ("baseline", "this") if args.baseline else ("this",)
        plan = [
            ("export", f" {size} {side}", ["--blocks", size, "--engines", str(Path(args.engines) / f"{side}-{size}")])
            for size in args.blocks
            for side in sides
        ]
    state: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for step, label, extra in plan:
        failed = {r["step"] for r in rows if r["exit"] != 0}  # skipped ones too
        if step in NEEDS and {NEEDS[step], NEEDS[step] + label} & failed:
            rows.append({"step": step + label, "exit": None, "error": f"skipped: {NEEDS[step]} failed"})
            continue
        print(f"== {step}{label}", file=sys.stderr, flush=True)
        source = args.baseline if label.endswith(" baseline") else None
        row = child(step, sys.argv[1:] + extra, state, source=source) | {"step": step + label}
        state |= row.get("result", {})
        rows.append(row)
    report(args, state, rows)


def report(args: argparse.Namespace, state: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    itemsize = {"fp32": 4, "fp16": 2, "bf16": 2}.get(state.get("precision", ""), 0)
    weight_bytes = state.get("parameters", 0) * itemsize
    for row in rows:
        if weight_bytes and row.get("peak_rss_bytes"):
            row["peak_per_weight_bytes"] = round(row["peak_rss_bytes"] / weight_bytes, 2)
    summary = {"model": args.model, "component": state.get("component"), "precision": state.get("precision"),
               "exporter": state.get("exporter"), "parameters": state.get("parameters"), "weight_bytes": weight_bytes,
               "steps": rows}  # fmt: skip
    print(f"\n{args.model} {state.get('component')}: {state.get('parameters', 0) / 1e6:.1f} M parameters, "
          f"{weight_bytes / 2**30:.2f} GiB at the graph's precision ({state.get('exporter')} exporter)")  # fmt: skip
    print(f"{'step':<24} {'wall s':>8} {'CPU s':>8} {'peak RSS GiB':>13} {'peak/weights':>13}  result")
    for row in rows:
        rss = f"{row['peak_rss_bytes'] / 2**30:.2f}" if "peak_rss_bytes" in row else "-"
        ratio = f"{row['peak_per_weight_bytes']:.2f}" if "peak_per_weight_bytes" in row else "-"
        wall, cpu = (f"{row[k]:.1f}" if k in row else "-" for k in ("wall_s", "cpu_s"))
        print(
            f"{row['step']:<24} {wall:>8} {cpu:>8} {rss:>13} {ratio:>13}  {row.get('error') or outcome(row['result'])}"
        )
    if any("phases" in row.get("result", {}) for row in rows):
        print_phases(rows)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def print_phases(rows: list[dict[str, Any]]) -> None:
    """The exports' phases, wall / CPU seconds (the whole export: its child process, building the preset included)."""
    print(f"\n{'export':<24} {'torch.export':>14} {'optimizer':>14} {'whole export':>14}")
    for row in rows:
        if phases := row.get("result", {}).get("phases"):
            cells = [
                f"{phases.get(f'{p}_s', 0):.1f} / {phases.get(f'{p}_cpu_s', 0):.1f}"
                for p in ("torch_export", "optimizer")
            ]
            print(f"{row['step']:<24} {cells[0]:>14} {cells[1]:>14} {row['wall_s']:>6.1f} / {row['cpu_s']:<6.1f}")


def outcome(result: dict[str, Any]) -> str:
    """What a step made, in a few words."""
    if "passed" in result:
        return ("PASS " if result["passed"] else "FAIL ") + ", ".join(result["blocks"])
    if "method" in result:
        return f"method {result['method']}"
    if "mapped" in result:
        return f"{result['mapped']} mapped, {result['unmapped']} unmapped"
    return ", ".join(f"{k} {v}" for k, v in result.items() if k in ("export", "weights", "model"))


if __name__ == "__main__":
    main()
