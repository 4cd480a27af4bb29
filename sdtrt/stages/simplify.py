"""Simplify stage: onnxsim, or constant folding + cleanup (onnx-graphsurgeon) when onnxsim fails, or — for graphs
whose weights are too big to load — a cleanup that never loads them (``stream``).

``stream`` (simplify_stream.py) cleans a graph up without ever loading its weights, and changes no arithmetic (it
bypasses Identity nodes, drops dead ones and folds shape constants): ``auto`` takes it for every graph over 64 MiB of
weights (every Stable Diffusion network) or too big for the memory budget, onnxsim for the small ones.

The result is accepted only after ONNX Runtime gives the same output for it and its input graph —
except for bf16 graphs, which ONNX Runtime on a CPU cannot run (sdtrt.core.config.BF16_ON_ONNXRUNTIME). bf16 graphs,
headed for TensorRT, then get their Resize and Sin/Cos nodes computed in fp32 (graph_passes): here rather
than at export, so the export stays the faithful trace of the PyTorch module and no simplifier runs after
the pass to fold its casts away, as NVIDIA's demo does it in its graph optimizer. The manifest records which
path ran, why, the op counts before and after, and the nodes the pass wrapped.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import BF16_ON_ONNXRUNTIME, SimplifyConfig, SimplifyMethod, format_size
from ..core.errors import SimplifyError
from ..core.progress import console, step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..graph import onnx_graph
from ..runtime.compare import compare_graphs
from ..runtime.onnxruntime import quiet_default_logger
from .simplify_stream import stream

STAGE = "simplify"
# 1 still: the method that runs is part of the key (run's "simplify-plan" input), so moving auto's threshold changes
# the keys of exactly the graphs whose method it changes.
VERSION = 1
# auto streams graphs over this: onnxsim peaks at ~5.5x an SD 1.5 fp16 graph's weights (1.6 GiB → 9 GB,
# ENVIRONMENT.md) for ~7% fewer nodes than stream leaves (the tiny fp16 UNet from torch.export's exporter: 520 and
# 561, both equal to their input on ONNX Runtime). The tiny presets' graphs (6 MB at most) keep onnxsim.
STREAM_ABOVE = 64 * 2**20
ONNXSIM_PEAK_RATIO = 6  # that measured peak, rounded up: auto streams where it would not fit the budget
# The check runs the input and the result on ONNX Runtime one after the other, in lean sessions (no fp32 copies of
# the weights, runtime/onnxruntime.py session_options): SD 1.5's fp16 UNet, 1.6 GiB of weights, peaks at 3.1 GiB
# (2x; 6.3 GiB before the sessions were lean). 4 leaves room for graphs whose activations weigh more than SD 1.5's.
CHECK_PEAK_RATIO = 4


def run(config: SimplifyConfig, source: Artifact, store: Store) -> Artifact:
    plan = plan_for(config, source)
    # Keyed by what runs (the method auto picks under this budget, whether ONNX Runtime checks the result), so a
    # graph simplified under a small budget, unchecked, is never the answer to a request that can afford the check.
    checked = config.check and not plan.unchecked
    runs = {"kind": "simplify-plan", "digest": f"{plan.method}, {'checked' if checked else 'unchecked'}"}
    request = StageRequest(
        STAGE, VERSION, config, [source.as_input(), runs], environment("onnx", "onnxsim", "onnx-graphsurgeon")
    )
    with contextlib.redirect_stdout(sys.stderr):  # onnx-graphsurgeon prints warnings: stdout is for results
        artifact, _ = store.produce(request, lambda out_dir: _simplify(config, source, plan, out_dir))
    return artifact


@dataclass(frozen=True)
class Plan:
    """What simplify does with a graph under a config, decided before its key (which says it) and its work."""

    weight_bytes: int
    budget: int
    method: SimplifyMethod  # what auto picks, or what was asked for (a Q/DQ graph or an onnxsim failure may fold)
    method_reason: str
    unchecked: str | None  # why ONNX Runtime cannot check the result here, or None when it can


def plan_for(config: SimplifyConfig, source: Artifact) -> Plan:
    """The plan for ``source``, from its graph without its weights; a corrupt input fails here, before any work."""
    weight_bytes, budget = onnx_graph.initializer_bytes(onnx_graph.load_graph(source.primary)), config.budget()
    method, method_reason = choose_method(config.method, weight_bytes, budget)
    precision = onnx_graph.artifact_spec(source).precision
    unchecked = BF16_ON_ONNXRUNTIME if precision == "bf16" else too_big_to_check(weight_bytes, budget)
    return Plan(weight_bytes, budget, method, method_reason, unchecked)


def _simplify(config: SimplifyConfig, source: Artifact, plan: Plan, out_dir: Path) -> dict[str, Any]:
    spec = onnx_graph.artifact_spec(source)
    out_path = out_dir / f"{spec.component}.sim.onnx"
    before = onnx_graph.op_counts(source.primary)
    weight_bytes, budget, method, method_reason = plan.weight_bytes, plan.budget, plan.method, plan.method_reason
    timings: dict[str, float] = {}
    fallback_reason = weights_carried = None
    # onnxsim folds a weight's QuantizeLinear→DequantizeLinear pair into a float weight (15 of the tiny UNet's 54
    # INT8 weight pairs, measured), leaving TensorRT nothing to run in 8 bits: Q/DQ graphs are folded with their
    # Q/DQ nodes excluded instead.
    keeps_qdq = bool(before["QuantizeLinear"] + before["TRT_FP8QuantizeLinear"])
    if keeps_qdq and method == "onnxsim":
        method, fallback_reason = (
            "fold",
            "a Q/DQ graph: constants folded with its Q/DQ nodes kept (onnxsim folds weight Q/DQ pairs into float "
            "weights, which TensorRT then runs in high precision)",
        )
    started = time.perf_counter()
    if method == "onnxsim":
        try:
            with step(f"Simplifying with onnxsim ({sum(before.values())} nodes)"):
                _onnxsim(source.primary, out_path)
        except Exception as exc:  # onnxsim raises RuntimeError, MemoryError, onnx errors, …
            if config.method == "onnxsim":
                raise SimplifyError(f"onnxsim failed: {exc}; retry with --method fold (or stream)") from exc
            fallback_reason = f"onnxsim failed: {type(exc).__name__}: {str(exc)[:300]}"
            method = "fold"
            for leftover in out_dir.iterdir():
                leftover.unlink()
    if method == "fold":
        with step("Folding constants and cleaning up (onnx-graphsurgeon)"):
            _fold(source.primary, out_path, keep_qdq=keeps_qdq)
    if method == "stream":
        with step(f"Cleaning up without loading the weights ({format_size(weight_bytes)} stay on disk)"):
            weights_carried = stream(source.primary, out_path)
    timings["simplify_s"] = round(time.perf_counter() - started, 3)
    computed_in_fp32 = None
    if spec.precision == "bf16":
        from .graph_passes import FP32_OPS, compute_in_fp32_file

        with step("Computing Resize, Sin and Cos in fp32 (bf16 graph for TensorRT)"):
            computed_in_fp32 = {"nodes": compute_in_fp32_file(out_path), "why": FP32_OPS}
    onnx_graph.check(out_path)
    after = onnx_graph.op_counts(out_path)

    check = None
    unchecked = plan.unchecked
    if config.check and unchecked and spec.precision != "bf16":
        console.print(f"[yellow]![/] Not checking the simplified graph on ONNX Runtime: {unchecked}")
    if config.check and not unchecked:
        started = time.perf_counter()
        with step("Checking the simplified graph against its input on ONNX Runtime"):
            check = compare_graphs(source.primary, out_path, spec)
        timings["check_s"] = round(time.perf_counter() - started, 3)
        if check["cosine"] < config.check_min_cosine:
            raise SimplifyError(
                f"the {method} result differs from its input (cosine {check['cosine']:.6f} < "
                f"{config.check_min_cosine}); retry with --method {'fold' if method == 'onnxsim' else 'onnxsim'}"
            )
    return {
        "primary": out_path.name,
        "io": spec.to_json(),
        "timings": timings,
        "details": {
            "method": method,
            "method_reason": method_reason,
            "fallback_reason": fallback_reason,
            "weight_bytes": weight_bytes,
            "memory_budget": budget,
            "weights_carried": weights_carried,
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "op_counts_before": dict(sorted(before.items())),
            "op_counts_after": dict(sorted(after.items())),
            "check": check,
            "check_skipped": unchecked if config.check else None,
            "computed_in_fp32": computed_in_fp32,
            "external_data": onnx_graph.data_file(out_path).exists(),
        },
        "reproduce": f"sdtrt simplify {source.path} --method {config.method}"
        + (f" --memory-budget {config.memory_budget}" if config.memory_budget else "")
        + ("" if config.check else " --no-check"),
    }


def choose_method(requested: SimplifyMethod, weight_bytes: int, budget: int) -> tuple[SimplifyMethod, str]:
    """The method to run first (auto: stream for big graphs, else onnxsim), and why, for the manifest."""
    if requested != "auto":
        return requested, "asked for with --method"
    if weight_bytes * ONNXSIM_PEAK_RATIO > budget:
        return "stream", (
            f"onnxsim needs ~{ONNXSIM_PEAK_RATIO}x the {format_size(weight_bytes)} of weights, over the memory budget "
            f"({format_size(budget)})"
        )
    if weight_bytes > STREAM_ABOVE:
        return "stream", (
            f"{format_size(weight_bytes)} of weights, over the {format_size(STREAM_ABOVE)} auto loads: cleaned up "
            "without them, arithmetic unchanged"
        )
    return "onnxsim", f"{format_size(weight_bytes)} of weights: onnxsim fits the memory budget ({format_size(budget)})"


def too_big_to_check(weight_bytes: int, budget: int) -> str | None:
    """Why ONNX Runtime cannot check a graph with these weights within the budget, or None when it can."""
    if weight_bytes * CHECK_PEAK_RATIO <= budget:
        return None
    return (
        f"its {format_size(weight_bytes)} of weights need up to ~{CHECK_PEAK_RATIO}x that on ONNX Runtime (2x "
        f"measured for SD 1.5's fp16 UNet), over the memory budget ({format_size(budget)}); check it by parts "
        "(sdtrt check-blocks)"
    )


def _onnxsim(source: Path, out_path: Path) -> None:
    import onnxsim

    # Paths, not loaded models: onnxsim then streams external data and peaks far lower.
    _, ok = onnxsim.simplify(str(source), output_path=str(out_path), external_data_threshold="2GB")
    if not ok:
        raise RuntimeError("onnxsim reported that its result could not be validated")
    onnx_graph.normalise_layout(out_path, onnx_graph.weights_on_disk(source.parent))


def _fold(source: Path, out_path: Path, keep_qdq: bool = False) -> None:
    import onnx_graphsurgeon as gs

    graph = onnx_graph.import_for_surgery(onnx_graph.load_graph(source, with_weights=True))
    quiet_default_logger()  # fold_constants evaluates on ONNX Runtime
    graph.fold_constants(should_exclude_node=_is_qdq if keep_qdq else None).cleanup().toposort()
    weight_bytes = onnx_graph.weights_on_disk(source.parent)
    onnx_graph.save(gs.export_onnx(graph), out_path, weight_bytes)


def _is_qdq(node: Any) -> bool:
    """A quantize/dequantize node: standard, or ModelOpt's trt:: FP8 ones (quantize.py)."""
    return node.op in ("QuantizeLinear", "DequantizeLinear") or node.domain == "trt"


def op_table_rows(before: dict[str, int], after: dict[str, int]) -> list[tuple[str, int, int]]:
    """(op, before, after) rows, as onnx-simplifier prints them, with a Total row last."""
    ops = sorted(set(before) | set(after))
    rows = [(op, before.get(op, 0), after.get(op, 0)) for op in ops]
    rows.append(("Total", sum(before.values()), sum(after.values())))
    return rows
