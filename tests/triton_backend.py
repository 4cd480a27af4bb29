"""What sdtrt's Triton model reads of ``triton_python_backend_utils`` (the Python backend's module, which exists only
inside Triton), so the model's ``execute`` runs in the test process on real numpy rows. Triton itself, with its type
and dims checks of config.pbtxt, runs in tests/test_serve.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np


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
