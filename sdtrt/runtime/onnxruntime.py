"""ONNX Runtime: runs fp16 and fp32 UNet graphs on the CPU here, with the CUDA provider where present."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import ShapeError
from ..onnx_graph import graph_io
from ..spec import TensorSpec

TORCH_DTYPES = {"float16": torch.float16, "float32": torch.float32, "int64": torch.int64}


def available_providers() -> list[str]:
    import onnxruntime as ort

    return list(ort.get_available_providers())


class OnnxRuntime:
    """An InferenceSession over one .onnx, with inputs cast to the graph's dtypes."""

    name = "onnxruntime"

    def __init__(self, path: Path, providers: Sequence[str] | None = None, threads: int = 0) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        self._providers = list(providers or _default_providers())
        self._session = ort.InferenceSession(str(path), options, providers=self._providers)
        self._inputs, self._outputs = graph_io(path)

    @property
    def inputs(self) -> list[TensorSpec]:
        return self._inputs

    @property
    def outputs(self) -> list[TensorSpec]:
        return self._outputs

    @property
    def device(self) -> torch.device:
        return torch.device("cuda" if self._providers[0] == "CUDAExecutionProvider" else "cpu")

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self._inputs[0].dtype]

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        arrays = {}
        for spec in self._inputs:
            if spec.name not in feeds:
                raise ShapeError(f"input '{spec.name}' is missing; the graph takes {[s.name for s in self._inputs]}")
            tensor = feeds[spec.name].detach().to("cpu", TORCH_DTYPES[spec.dtype])
            if tensor.dim() != len(spec.shape):
                raise ShapeError(f"input '{spec.name}' has {tensor.dim()} dims; the graph wants shape {spec.shape}")
            arrays[spec.name] = np.ascontiguousarray(tensor.numpy())
        results = self._session.run([o.name for o in self._outputs], arrays)
        return {o.name: torch.from_numpy(r) for o, r in zip(self._outputs, results, strict=True)}

    def close(self) -> None:
        del self._session


def _default_providers() -> list[str]:
    wanted = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    have = available_providers()
    return [p for p in wanted if p in have]
