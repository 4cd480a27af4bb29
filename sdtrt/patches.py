"""Scoped, reversible patches applied to torch while a model is exported.

Each patch is a named context manager; ``export_patches`` enters them together and yields the names
so the export manifest records exactly what was in effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


@contextlib.contextmanager
def replaced(replacements: Mapping[tuple[Any, str], Any]) -> Iterator[None]:
    """Set each ``(owner, attribute)`` to its value; restore the originals on exit, also on error."""
    originals = {key: getattr(*key) for key in replacements}
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in originals.items():
            setattr(owner, name, value)


def broadcast_to_as_expand() -> contextlib.AbstractContextManager[None]:
    """Route ``torch.broadcast_to`` / ``Tensor.broadcast_to`` through ``Tensor.expand``.

    Both mean the same for the shapes the UNet uses, but ``expand`` maps to ONNX ``Expand`` in every
    exporter and opset, while ``broadcast_to`` has exported to unsupported or shape-specialised ops
    in some; TensorRT's parser also handles ``Expand`` with dynamic shapes.
    """

    def as_expand(tensor: torch.Tensor, size: Any) -> torch.Tensor:
        return tensor.expand(size)

    return replaced({(torch, "broadcast_to"): as_expand, (torch.Tensor, "broadcast_to"): as_expand})


def concat_as_cat() -> contextlib.AbstractContextManager[None]:
    """Route ``torch.concat`` / ``torch.concatenate`` (aliases, ``axis=`` included) through ``torch.cat``.

    Eager PyTorch type-promotes all three (fp16 ⊕ fp32 → fp32); ONNX ``Concat`` needs one type. torch.export
    records the aliases as ``aten.concat``/``aten.concatenate`` (not decomposed: onnxscript's torchlib implements
    them), and the exporter's type promotion pass has a rule for ``aten.cat`` alone (torch 2.13
    torch/onnx/_internal/fx/passes/type_promotion.py, ``_GENERATED_ATEN_TYPE_PROMOTION_RULE_SET``), so a mixed
    ``torch.concat`` became a mixed Concat ONNX Runtime refuses: diffusers' ``get_aug_embed`` joins SDXL's fp16
    ``text_embeds`` with fp32 time embeddings. As ``aten.cat`` it gets the Cast eager promotion implies.
    The table misses other aliases the same way (``torch.multiply``, ``subtract``, ``divide``, ``greater``: mixed
    dtypes give a mixed-type ONNX node); diffusers' networks call none of them, only these two, 37 times.
    """
    return replaced({(torch, "concat"): torch.cat, (torch, "concatenate"): torch.cat})


EXPORT_PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "broadcast_to->expand": broadcast_to_as_expand,
    "concat->cat": concat_as_cat,
}


@contextlib.contextmanager
def export_patches() -> Iterator[list[str]]:
    """Apply every export patch; undo all of them on exit, also on error."""
    with contextlib.ExitStack() as stack:
        for patch in EXPORT_PATCHES.values():
            stack.enter_context(patch())
        yield list(EXPORT_PATCHES)
