"""Runtimes: one small interface over every backend that can run a UNet graph.

A runtime takes a dict of named torch tensors and returns a dict of named torch tensors. It knows
its input specs, device and compute dtype, and checks every request against the shapes it was
built for before running it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from ..spec import TensorSpec


class Runtime(Protocol):
    name: str

    @property
    def inputs(self) -> list[TensorSpec]: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in (and wants sample/encoder_hidden_states in)."""
        ...

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...
