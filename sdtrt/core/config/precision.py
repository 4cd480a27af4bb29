"""Graph precisions and the targets that build and run them, and which precision a target cannot take."""

from __future__ import annotations

from typing import Literal

Precision = Literal["fp16", "bf16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("fp16", "bf16", "fp32")
# tensorrt-rtx: NVIDIA TensorRT for RTX, built ahead of time without a GPU (sdtrt/core/trt_products.py).
ConcreteTarget = Literal["onnxruntime", "tensorrt", "tensorrt-rtx"]
Target = Literal["auto", "onnxruntime", "tensorrt", "tensorrt-rtx"]

# ONNX Runtime 1.31's CPU provider has no bfloat16 kernel for Conv, Gemm or even Add: none of the tiny UNet,
# VAE or CLIP bf16 graphs loads there (measured; session creation fails with NOT_IMPLEMENTED). bf16 is for
# TensorRT, whose strongly typed networks take it as they take fp16.
BF16_ON_ONNXRUNTIME = (
    "ONNX Runtime on a CPU cannot run bf16 graphs (it has no bfloat16 Conv, Gemm or Add kernels): bf16 is for "
    "--target tensorrt; use --precision fp16 or fp32 for onnxruntime"
)


def target_precision_problem(target: str, precision: str) -> str | None:
    """Why graphs of this precision cannot be built or run for this (resolved) target, or None."""
    return BF16_ON_ONNXRUNTIME if target == "onnxruntime" and precision == "bf16" else None
