"""Refitting a TensorRT engine with LoRA weights: the TensorRT Weights it takes and the base values it also needs."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.artifact import located
from ..core.errors import LoraError

if TYPE_CHECKING:
    import tensorrt as trt


class BaseWeights:
    """Base values of the weights a refit must supply although no LoRA changed them (TensorRT's missing weights).

    Read from the graph the plan was parsed from, only the named initializers (never the whole 1.7–5 GB
    graph), and each once: the same names are missing on every refit.
    """

    def __init__(self, graph: Path) -> None:
        self.graph = graph
        self._held: dict[str, np.ndarray] = {}

    def __call__(self, names: set[str]) -> dict[str, np.ndarray]:
        from ..graph.graph_weights import read_named_initializers

        if unread := names - set(self._held):
            self._held |= read_named_initializers(self.graph, unread)
        if absent := sorted(names - set(self._held)):
            # The ONNX parser names most refittable weights after initializers, but also after Constant-node
            # outputs and temporary weights it makes (onnx-tensorrt ModelRefitter.cpp refitOnnxConstantNode,
            # BatchNorm's createNamedTempWeights(..., refittable=true)), which only the parser can recompute.
            raise LoraError(
                f"TensorRT needs the weight '{absent[0]}' to refit, and it is not an initializer of {self.graph} "
                "(TensorRT may have named a constant the parser made), so sdtrt cannot supply it: this engine takes "
                "no LoRA by refit; apply the LoRA without the engine (`generate --lora` without `--engine`)"
            )
        return {name: self._held[name] for name in names}


def parsed_graph(manifest: dict[str, Any], plan: Path) -> Path:
    """The ONNX graph ``plan`` was parsed from, whose initializers name its refittable weights (the ONNX parser names
    each after its initializer, INetworkDefinition::setWeightsName): the one its build's worker request names, in the
    plan's store first. For a quantized graph that is the quantize stage's TensorRT graph (16-bit outside its Q/DQ
    pairs), not the primary graph of the artifact the plan was built from (ONNX Runtime's, fp32), whose weights
    set_named_weights would refuse (another dtype than get_weights_prototype's)."""
    parsed = Path(manifest["details"]["worker_request"]["onnx"])
    return located(parsed.parent, plan.parents[2]) / parsed.name


def refit_weights(trt: ModuleType, array: np.ndarray) -> trt.Weights:
    """TensorRT Weights over a contiguous host array, which must outlive the refit.

    trt.Weights(array) maps numpy dtypes to TensorRT's and raises ValueError for ml_dtypes' bfloat16, the dtype ONNX
    gives bf16 initializers (python/src/utils.cpp ``type``: f4, f2, i8, i4, i1, b1, u1 only); a bf16 array goes
    through the pointer constructor ``Weights(type, ptr, count)`` instead, as demo/Diffusion's Engine.refit passes
    every weight (python/src/infer/pyFoundationalTypes.cpp ``weights_pointer_constructor``).
    """
    if array.dtype.name == "bfloat16":
        return trt.Weights(trt.DataType.BF16, array.ctypes.data, array.size)
    return trt.Weights(array)
