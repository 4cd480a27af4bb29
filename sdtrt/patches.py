"""Scoped, reversible patches applied to torch while a model is exported.

Each patch is a named context manager; ``export_patches`` enters them together and yields the names
so the export manifest records exactly what was in effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def broadcast_to_as_expand() -> Iterator[None]:
    """Route ``torch.broadcast_to`` / ``Tensor.broadcast_to`` through ``Tensor.expand``.

    Both mean the same for the shapes the UNet uses, but ``expand`` maps to ONNX ``Expand`` in every
    exporter and opset, while ``broadcast_to`` has exported to unsupported or shape-specialised ops
    in some; TensorRT's parser also handles ``Expand`` with dynamic shapes.
    """
    original_fn = torch.broadcast_to
    original_method = torch.Tensor.broadcast_to

    def as_expand(tensor: torch.Tensor, size: Any) -> torch.Tensor:
        return tensor.expand(size)

    torch.broadcast_to = as_expand  # type: ignore[assignment]
    torch.Tensor.broadcast_to = as_expand  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.broadcast_to = original_fn
        torch.Tensor.broadcast_to = original_method  # type: ignore[method-assign]


EXPORT_PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "broadcast_to->expand": broadcast_to_as_expand,
}


@contextlib.contextmanager
def export_patches() -> Iterator[list[str]]:
    """Apply every export patch; undo all of them on exit, also on error."""
    with contextlib.ExitStack() as stack:
        for patch in EXPORT_PATCHES.values():
            stack.enter_context(patch())
        yield list(EXPORT_PATCHES)
