"""Helpers for tests: drive the CLI as a user would, read graphs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = False, **kwargs
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sdtrt`` as a user would, capturing its output."""
    full_env = os.environ | {"SDTRT_DEBUG": "0"} | (env or {})
    result = subprocess.run(
        [sys.executable, "-m", "sdtrt", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=kwargs.pop("cwd", REPO),
        stdin=subprocess.DEVNULL,
        timeout=kwargs.pop("timeout", 600),
        **kwargs,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"sdtrt {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def softmax_input_types(graph_path: Path) -> set[int]:
    """The ONNX element types Softmax nodes take in a graph (weights not loaded)."""
    import onnx

    graph = onnx.shape_inference.infer_shapes(onnx.load(str(graph_path), load_external_data=False)).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input]}
    return {types[node.input[0]] for node in graph.node if node.op_type == "Softmax"}
