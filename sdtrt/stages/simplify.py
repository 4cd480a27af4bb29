"""Simplify stage: onnxsim, or constant folding + cleanup (onnx-graphsurgeon) when onnxsim fails.

The result is accepted only after ONNX Runtime gives the same output for it and its input graph —
except for bf16 graphs, which ONNX Runtime on a CPU cannot run (config.BF16_ON_ONNXRUNTIME). bf16 graphs,
headed for TensorRT, then get their Resize and Sin/Cos nodes computed in fp32 (graph_passes): here rather
than at export, so the export stays the faithful trace of the PyTorch module and no simplifier runs after
the pass to fold its casts away, as NVIDIA's demo does it in its graph optimizer. The manifest records which
path ran, why, the op counts before and after, and the nodes the pass wrapped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import onnx_graph
from ..config import BF16_ON_ONNXRUNTIME, SimplifyConfig
from ..errors import SimplifyError
from ..progress import step
from ..runtime.compare import compare_graphs
from ..store import Artifact, StageRequest, Store, environment

STAGE = "simplify"
VERSION = 1  # bf16 graphs (new) also get the fp32 passes; fp16/fp32 results are unchanged


def run(config: SimplifyConfig, source: Artifact, store: Store) -> Artifact:
    onnx_graph.load_graph(source.primary)  # a corrupt input fails here, before any work is cached
    request = StageRequest(
        STAGE, VERSION, config, [source.as_input()], environment("onnx", "onnxsim", "onnx-graphsurgeon")
    )
    artifact, _ = store.produce(request, lambda out_dir: _simplify(config, source, out_dir))
    return artifact


def _simplify(config: SimplifyConfig, source: Artifact, out_dir: Path) -> dict[str, Any]:
    spec = onnx_graph.artifact_spec(source)
    out_path = out_dir / f"{spec.component}.sim.onnx"
    before = onnx_graph.op_counts(source.primary)
    timings: dict[str, float] = {}
    # onnxsim folds a weight's QuantizeLinear→DequantizeLinear pair into a float weight (15 of the tiny UNet's 54
    # INT8 weight pairs, measured), leaving TensorRT nothing to run in 8 bits: Q/DQ graphs are folded with their
    # Q/DQ nodes excluded instead.
    keeps_qdq = bool(before["QuantizeLinear"] + before["TRT_FP8QuantizeLinear"])
    fallback_reason = (
        "a Q/DQ graph: folded with its Q/DQ nodes kept (onnxsim folds weight Q/DQ pairs)" if keeps_qdq else None
    )
    method = "fold" if config.method == "fold" or keeps_qdq else "onnxsim"
    started = time.perf_counter()
    if method == "onnxsim":
        try:
            with step(f"Simplifying with onnxsim ({sum(before.values())} nodes)"):
                _onnxsim(source.primary, out_path)
        except Exception as exc:  # onnxsim raises RuntimeError, MemoryError, onnx errors, …
            if config.method == "onnxsim":
                raise SimplifyError(f"onnxsim failed: {exc}; retry with --method fold") from exc
            fallback_reason = f"onnxsim failed: {type(exc).__name__}: {str(exc)[:300]}"
            method = "fold"
            for leftover in out_dir.iterdir():
                leftover.unlink()
    if method == "fold":
        with step("Folding constants and cleaning up (onnx-graphsurgeon)"):
            _fold(source.primary, out_path, keep_qdq=keeps_qdq)
    timings["simplify_s"] = round(time.perf_counter() - started, 3)
    computed_in_fp32 = None
    if spec.precision == "bf16":
        from .graph_passes import FP32_OPS, compute_in_fp32_file

        with step("Computing Resize, Sin and Cos in fp32 (bf16 graph for TensorRT)"):
            computed_in_fp32 = {"nodes": compute_in_fp32_file(out_path), "why": FP32_OPS}
    onnx_graph.check(out_path)
    after = onnx_graph.op_counts(out_path)

    check = None
    unchecked = BF16_ON_ONNXRUNTIME if spec.precision == "bf16" else None
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
            "fallback_reason": fallback_reason,
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "op_counts_before": dict(sorted(before.items())),
            "op_counts_after": dict(sorted(after.items())),
            "check": check,
            "check_skipped": unchecked if config.check else None,
            "computed_in_fp32": computed_in_fp32,
            "external_data": onnx_graph.data_file(out_path).exists(),
        },
        "reproduce": f"sdtrt simplify {source.path} --method {config.method}",
    }


def _onnxsim(source: Path, out_path: Path) -> None:
    import onnxsim

    # Paths, not loaded models: onnxsim then streams external data and peaks far lower.
    _, ok = onnxsim.simplify(str(source), output_path=str(out_path), external_data_threshold="2GB")
    if not ok:
        raise RuntimeError("onnxsim reported that its result could not be validated")
    onnx_graph.normalise_layout(out_path, onnx_graph.weights_on_disk(source.parent))


def _fold(source: Path, out_path: Path, keep_qdq: bool = False) -> None:
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(onnx_graph.load_graph(source, with_weights=True))
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
