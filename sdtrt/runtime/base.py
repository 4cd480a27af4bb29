"""The runtime contract: one small interface over every backend that can run a component's graph.

A runtime takes a dict of named torch tensors and returns a dict of named torch tensors. It knows
its spec, device and compute dtype, and checks every request against the shapes it was built for
before running it, so a bad request is a clear EngineInputError, not a crash deep in a backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..core.config import ShapeProfile
from ..core.errors import EngineInputError

if TYPE_CHECKING:
    from ..spec import GraphSpec


class Runtime(Protocol):
    name: str

    @property
    def spec(self) -> GraphSpec: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine computes in (and wants sample/encoder_hidden_states in)."""
        ...

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def close(self) -> None: ...


TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32,
                "int64": torch.int64}  # fmt: skip


def typed_inputs(spec: GraphSpec, feeds: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Inputs in the graph's dtypes, contiguous, on ``device`` (no copy when they already are)."""
    return {t.name: feeds[t.name].detach().to(device, TORCH_DTYPES[t.dtype]).contiguous() for t in spec.inputs()}


class CudaRuntime:
    """Device and dtype of runtimes that run on the current CUDA device (TensorRT, TorchScript)."""

    spec: GraphSpec

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.dtype]


def check_feeds(spec: GraphSpec, profile: ShapeProfile | None, feeds: dict[str, torch.Tensor]) -> None:
    """Raise EngineInputError unless ``feeds`` are tensors of the right kind whose shapes the engine takes."""
    kinds = {t.name: t.dtype.startswith("float") for t in spec.inputs()}
    for name, tensor in feeds.items():
        if name not in kinds:
            raise EngineInputError(f"unexpected input '{name}'; the engine takes {list(spec.input_names)}")
        if tensor.is_floating_point() != kinds[name]:
            wanted = "floating-point" if kinds[name] else "integer"
            raise EngineInputError(f"input '{name}' is {tensor.dtype}; the engine takes {wanted} tensors")
    reason = spec.check_shapes({name: tuple(t.shape) for name, t in feeds.items()}, profile)
    if not reason:
        return
    tokens = profile.tokens if profile is not None else None
    if profile is not None and spec.reads_pixels:
        # In pixels too: a pipeline called without height/width asks for its family's default (Flux's 1024²).
        takes = (
            f" (the engines take images {profile.width.min}–{profile.width.max} px wide and "
            f"{profile.height.min}–{profile.height.max} px high: pass the pipeline a height= and width= inside that)"
        )
    elif tokens is not None:  # a text encoder: its prompt length
        takes = f" (the engines take {tokens.min}–{tokens.max} text tokens: pass a max_sequence_length inside that)"
    else:
        takes = ""
    axes = ("--batch/--height/--width" if spec.reads_pixels else "--batch") + ("/--tokens" if tokens else "")
    raise EngineInputError(f"{reason}{takes}; or rebuild the engines with {axes} covering it")
