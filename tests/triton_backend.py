"""What sdtrt's Triton model reads of ``triton_python_backend_utils`` (the Python backend's module, which exists only
inside Triton), so the model's ``execute`` runs in the test process on real numpy rows. Triton itself, with its type
and dims checks of config.pbtxt, runs in tests/test_serve.py."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class InferenceRequest:
    """A request's inputs: name → numpy array, the batch dimension first."""

    def __init__(self, **inputs: Any) -> None:
        self.inputs = {name: Tensor(name, value) for name, value in inputs.items()}


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return request.inputs.get(name)


class TritonError(Exception):
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self.output_tensors, self.error = output_tensors or [], error

    def image(self) -> np.ndarray:
        """The response's images; AssertionError with its message for an error."""
        assert self.error is None, self.error.message()
        return next(t.as_numpy() for t in self.output_tensors if t.name() == "image")


class Metric:
    def __init__(self) -> None:
        self.value = 0

    def increment(self, by: int) -> None:
        self.value += by


class MetricFamily:
    COUNTER = "counter"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str]) -> Metric:  # the backend's name
        return Metric()


Logger = SimpleNamespace(log_warn=print)


@contextlib.contextmanager
def served(engine: Any, repository: Path) -> Iterator[Any]:
    """``engine`` deployed to ``repository`` and its Triton model initialized as the Python backend would on a CPU
    instance; this module stands in for the backend's while the block runs."""
    from sdtrt.serving.deploy import deploy_triton
    from sdtrt.serving.triton_model import TritonPythonModel

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "triton_python_backend_utils", sys.modules[__name__])
        deployment = deploy_triton(engine, repository)
        model = TritonPythonModel()
        args = {"model_repository": str(deployment.folder), "model_name": deployment.folder.name, "model_version": "1",
                "model_instance_kind": "CPU", "model_instance_device_id": "0"}  # fmt: skip
        model.initialize(args)
        yield model


def row(prompt: str, **inputs: Any) -> InferenceRequest:
    """A one-row request as a Triton client sends it: scalars [1, 1], images (numpy or PIL) [1, h, w, channels]."""
    dtypes = {"steps": np.int32, "seed": np.uint64, "height": np.int32, "width": np.int32, "strength": np.float32,
              "guidance": np.float32}  # fmt: skip
    tensors = {"prompt": np.array([[prompt.encode()]], dtype=object)}
    for name, value in inputs.items():
        if isinstance(value, str):  # negative_prompt
            tensors[name] = np.array([[value.encode()]], dtype=object)
        elif name in dtypes:
            tensors[name] = np.array([[value]], dtype=dtypes[name])
        else:
            pixels = np.asarray(value, dtype=np.uint8)
            tensors[name] = pixels.reshape(1, *pixels.shape[:2], -1)
    return InferenceRequest(**tensors)
