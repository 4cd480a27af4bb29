"""8-bit engines (issue 22): the TensorRT build of Q/DQ graphs, its refusals, and LoRAs on quantized engines.

The capability rule and the optimization level are pure functions, checked here without a GPU; the builds
themselves are `gpu` tests (skipped where CUDA or TensorRT is missing).
"""

from __future__ import annotations

import pytest

from sdtrt.config import default_optimization_level
from sdtrt.gpu import quantization_problem


@pytest.mark.parametrize(
    ("precision", "capability", "refused"),
    [
        ("fp8", "8.6", True),  # Ampere (A10, RTX 30xx): no FP8 Tensor Cores
        ("fp8", "8.0", True),
        ("fp8", "8.9", False),  # Ada (L4, L40S, RTX 40xx)
        ("fp8", "9.0", False),  # Hopper
        ("fp8", "12.0", False),  # Blackwell: a two-digit major compares as a number, not as text
        ("int8", "7.0", True),  # Volta
        ("int8", "7.5", False),  # Turing
        ("int8", "8.6", False),
    ],
)
def test_8bit_engines_need_their_compute_capability(precision, capability, refused):
    problem = quantization_problem(precision, capability, "NVIDIA X")
    assert (problem is not None) == refused
    if refused:
        assert "\n" not in problem
        need = "8.9" if precision == "fp8" else "7.5"
        assert f"{precision.upper()} engines need a GPU of compute capability {need} or newer" in problem
        assert f"NVIDIA X has {capability}" in problem and "use --precision" in problem


def test_q_dq_graphs_build_at_level_4_as_nvidia_builds_them_unless_huge():
    assert default_optimization_level(900_000_000, "int8")[0] == 4
    assert "FP8 Q/DQ: level 4" in default_optimization_level(900_000_000, "fp8")[1]
    assert default_optimization_level(900_000_000)[0] == 3
    assert default_optimization_level(12_000_000_000, "fp8")[0] == 3  # Flux: NVIDIA's demo keeps 3 for memory
