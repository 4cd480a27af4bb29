"""FreeU in a graph: diffusers' FreeU with its four factors a graph input, and its Fourier filter as real matmuls.

diffusers applies FreeU (Si et al. 2023) in the first two up blocks (``resolution_idx`` 0 and 1) of UpBlock2D and
CrossAttnUpBlock2D, layer by layer: the backbone feature's first half of channels times ``b1``/``b2``, the skip
feature through ``fourier_filter`` with its lowest frequencies times ``s1``/``s2`` (diffusers 0.42
``utils/torch_utils.py`` ``apply_freeu``). The blocks read their factors as Python numbers and filter with
``torch.fft``, which the exporters and TensorRT take poorly; ``freeu_call`` runs the network with the blocks' FreeU on
and their ``apply_freeu`` replaced by ``graph_apply_freeu``, which reads the factors from a tensor and filters with
``low_pass`` matrices built in the graph from the feature's height and width (dynamic shapes stay dynamic).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from .patches import replaced


def freeu_call(network: Any, unet: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``unet`` (the graph module's call of ``network``) with FreeU on, its factors (s1, s2, b1, b2) the last input."""

    def call(*inputs: torch.Tensor) -> torch.Tensor:
        with freeu_factors(network, inputs[-1]):
            return unet(*inputs)

    return call


@contextlib.contextmanager
def freeu_factors(network: Any, factors: torch.Tensor) -> Iterator[None]:
    """The network's up blocks run FreeU with ``factors``: enable_freeu turns their FreeU branch on (its values, which
    they only test for truth, are never read: a tensor's truth would be folded into the graph as a constant) and
    ``apply_freeu``, which the blocks' module calls, reads the tensor."""
    from diffusers.models.unets import unet_2d_blocks

    network.enable_freeu(s1=1.0, s2=1.0, b1=1.0, b2=1.0)
    try:
        with replaced({(unet_2d_blocks, "apply_freeu"): partial(graph_apply_freeu, factors)}):
            yield
    finally:
        network.disable_freeu()


def graph_apply_freeu(
    factors: torch.Tensor, resolution_idx: int, hidden_states: torch.Tensor, res_hidden_states: torch.Tensor,
    **_flags: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """diffusers' apply_freeu with (s1, s2, b1, b2) = ``factors``. The backbone's channels are scaled in fp32 and
    rounded to its dtype, as diffusers' tensor × Python float computes them."""
    if resolution_idx not in (0, 1):
        return hidden_states, res_hidden_states
    s, b = factors[resolution_idx], factors[2 + resolution_idx]
    half = hidden_states.shape[1] // 2
    boosted = (hidden_states[:, :half].float() * b).to(hidden_states.dtype)
    return torch.cat([boosted, hidden_states[:, half:]], dim=1), fourier_filter(res_hidden_states, s)


def fourier_filter(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """diffusers' ``fourier_filter(x, threshold=1, scale)``: ``real(ifft2(M ⊙ fft2(x)))`` for M, after fftshift, 1
    but ``scale`` on the 2×2 block at the centre, i.e. on the frequencies {0, -1} of each axis. M is 1 + (scale - 1)
    on a separable low band, so the filter is x + (scale - 1)·real(P x Qᵀ) with P, Q the band's projectors over H
    and W, real matmuls. fp32 whatever x's dtype, as diffusers filters, and back to it."""
    y = x.float()
    p_re, p_im = low_pass(y.shape[-2], y.device)
    q_re, q_im = low_pass(y.shape[-1], y.device)
    low = p_re @ y @ q_re.T - p_im @ y @ q_im.T  # real(P y Qᵀ) for a real y
    return (y + (scale - 1) * low).to(x.dtype)


def low_pass(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(real, imaginary) part of P = F⁻¹ diag(m) F for the length-``n`` DFT F and m keeping frequencies 0 and n - 1
    (one frequency when n is 1), from cos/sin of the outer product k·a reduced mod n (exact in fp32, so the angles
    stay in [0, 2π))."""
    k = torch.arange(n, device=device, dtype=torch.float32)
    keep = ((k == 0) | (k == n - 1)).float()[:, None]
    angle = torch.remainder(k[:, None] * k[None, :], n) * (2 * math.pi / n)
    cos, sin = torch.cos(angle), torch.sin(angle)  # F = cos - i·sin, rows: frequency k, columns: position a
    kept_cos, kept_sin = keep * cos, keep * sin
    real = (cos.T @ kept_cos + sin.T @ kept_sin) / n
    imaginary = (sin.T @ kept_cos - cos.T @ kept_sin) / n
    return real, imaginary
