"""Scoped, reversible patches applied to torch while a model is exported.

Each patch is a named context manager; ``export_patches`` enters them together and yields the names
so the export manifest records exactly what was in effect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch


@contextlib.contextmanager
def replaced(replacements: Mapping[tuple[Any, str], Any]) -> Iterator[None]:
    """Set each ``(owner, attribute)`` to its value; restore the originals on exit, also on error: an attribute the
    owner only inherited (an instance's bound method, a base class's) is deleted again, not set."""
    originals = {key: getattr(*key) for key in replacements}
    inherited = {key for key in replacements if key[1] not in getattr(key[0], "__dict__", {})}
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in originals.items():
            if (owner, name) in inherited:
                delattr(owner, name)
            else:
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


def rms_norm_as_arithmetic() -> contextlib.AbstractContextManager[None]:
    """Write ``F.rms_norm`` (``torch.nn.RMSNorm``: Flux's and SD3.5's query/key norms) as x·rsqrt(mean(x²)+eps)·w.

    The TorchScript exporter has no symbolic for ``aten::rms_norm`` at any opset; these ops it has. (torch.export's
    exporter converts it itself.)
    """

    def rms_norm(
        input: torch.Tensor,  # F.rms_norm's parameter names: keyword calls still match
        normalized_shape: Sequence[int],
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor:
        eps = torch.finfo(input.dtype).eps if eps is None else eps  # torch's default
        dims = tuple(range(-len(normalized_shape), 0))
        normed = input * torch.rsqrt(input.pow(2).mean(dims, keepdim=True) + eps)
        return normed if weight is None else normed * weight

    return replaced({(torch.nn.functional, "rms_norm"): rms_norm})


def flux_rotary_unflattened() -> contextlib.AbstractContextManager[None]:
    """Flux's rotary embedding with ``unflatten``: diffusers' ``apply_rotary_emb`` reshapes by ``*x.shape[:-1]``, a
    slice of the shape the TorchScript tracer records as constants, so the graph ran only at the traced batch and
    token count. The same arithmetic, other cases left to diffusers."""
    from diffusers.models.transformers import transformer_flux

    rotary = transformer_flux.apply_rotary_emb

    def apply_rotary_emb(
        x: torch.Tensor,
        freqs_cis: torch.Tensor | tuple[torch.Tensor],
        use_real: bool = True,
        use_real_unbind_dim: int = -1,
        sequence_dim: int = 2,
    ) -> Any:
        if not (use_real and use_real_unbind_dim == -1 and sequence_dim == 1):
            return rotary(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = (f[None, :, None, :] for f in freqs_cis)
        real, imaginary = x.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-imaginary, real], dim=-1).flatten(3)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    return replaced({(transformer_flux, "apply_rotary_emb"): apply_rotary_emb})


def integer_nearest_exact_as_nearest() -> contextlib.AbstractContextManager[None]:
    """``F.interpolate(mode="nearest-exact")`` by whole-number scale factors as ``mode="nearest"``: the same pixels
    (a target pixel d of scale s reads floor((d + 0.5) / s) = floor(d / s)), and the TorchScript exporter has no
    symbolic for ``aten::_upsample_nearest_exact2d`` (Qwen-Image's VAE decoder upsamples ×2 so). Other calls are
    left to torch."""
    interpolate = torch.nn.functional.interpolate

    def as_nearest(input: torch.Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                   *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        scales = scale_factor if isinstance(scale_factor, Sequence) else [scale_factor]
        whole = scale_factor is not None and all(float(f).is_integer() for f in scales)  # None: torch's own error
        if mode == "nearest-exact" and size is None and whole:
            mode = "nearest"
        return interpolate(input, size, scale_factor, mode, *args, **kwargs)

    return replaced({(torch.nn.functional, "interpolate"): as_nearest})


Patch = Callable[[], contextlib.AbstractContextManager[None]]
EXPORT_PATCHES: dict[str, Patch] = {
    "broadcast_to->expand": broadcast_to_as_expand,
    "concat->cat": concat_as_cat,
}
# Only the TorchScript exporter needs these (ModelOpt's Q/DQ graphs export through it alone).
TORCHSCRIPT_PATCHES: dict[str, Patch] = {
    "rms_norm->arithmetic": rms_norm_as_arithmetic,
    "flux rotary: unflatten": flux_rotary_unflattened,
    "nearest-exact xN->nearest": integer_nearest_exact_as_nearest,
}


@contextlib.contextmanager
def export_patches(exporter: str = "dynamo") -> Iterator[list[str]]:
    """Apply every export patch the ``exporter`` (dynamo or torchscript) needs; undo all of them on exit, also on
    error. Yields their names."""
    patches = EXPORT_PATCHES | (TORCHSCRIPT_PATCHES if exporter == "torchscript" else {})
    with contextlib.ExitStack() as stack:
        for patch in patches.values():
            stack.enter_context(patch())
        yield list(patches)
