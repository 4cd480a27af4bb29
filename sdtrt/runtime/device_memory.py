"""One activation buffer for the TensorRT and TensorRT-RTX engines of a pipeline, which run one after another.

Each execution context made with TensorRT's default strategy (STATIC) holds its engine's activation memory for its
whole life, so a set's resident memory is the sum over its members. NVIDIA's demo/Diffusion gives every engine of a
pipeline one buffer of the largest member's size instead (diffusion_pipeline.py ``activate_engines``:
``cudaMalloc(max(engine.device_memory_size_v2))``; engine.py ``activate``: contexts made USER_MANAGED), and so does
its TensorRT-RTX demo (demo/utils/pipeline.py ``activate_engines`` and ``calculate_max_device_memory``; a
TensorRT-RTX context takes USER_MANAGED from its runtime config). That is safe only while no two of those contexts
execute at once: TensorRT uses the memory "from the invocation of enqueueV3() until network execution is complete
... using it in another execution context running in parallel ... will result in undefined behavior"
(NvInferRuntime.h, IExecutionContext::setDeviceMemoryV2; tensorrt_rtx 1.7's IExecutionContext.device_memory
docstring says the same). A pipeline's members run in turn on the caller's stream (each runtime's stream waits for
the caller's before it runs, and the caller's for it after), so they never overlap; a runtime opened alone keeps the
default.

Each member reserves its engine's device_memory_size_v2, the size STATIC would allocate: "the maximum size across
all profiles", so no input shape needs more, in TensorRT-RTX's JIT-compiled, dynamic-shape plans too
(IExecutionContext.update_device_memory_size_for_shapes gives the current shapes' need, which is never larger: it
serves allocating less, not more; TensorRT-RTX samples/memoryManagement).

The buffer is a torch tensor, so PyTorch's caching allocator owns it: each runtime records its stream on it, so the
memory is not handed out again while work queued there may still use it. A captured CUDA graph bakes the buffer's
address in; the buffer stays the same for the pipeline's life unless a member that needs more joins after it was
made, which replaces it (``generation`` changes) and makes each runtime rebind its context and drop its graph. Only
sdtrt's own graphs can be dropped, so a TensorRT-RTX context that captures its own (WHOLE_GRAPH_CAPTURE, set on its
runtime config) keeps memory of its own instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..core.artifact import Artifact


class SharedDeviceMemory:
    """The activation buffer of a pipeline's TensorRT (and TensorRT-RTX) execution contexts, sized for the largest."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.needed = 0  # the largest size a member reserved (its engine's device_memory_size_v2)
        self.generation = 0  # which buffer: bumped each time one is made
        self._buffer: torch.Tensor | None = None

    def reserve(self, size: int) -> None:
        """A member's need, read after any weight streaming budget is set (it adds the streaming scratch memory:
        NvInferRuntime.h getDeviceMemorySizeV2 "is stateful ... setWeightStreamingBudgetV2()")."""
        self.needed = max(self.needed, size)

    def buffer(self) -> torch.Tensor:
        """The buffer, made on first use; a new one when a later member needs more than it holds."""
        if self._buffer is None or self._buffer.numel() < self.needed:
            if self._buffer is not None:  # contexts may still run on the old one: let them finish first
                torch.cuda.synchronize(self.device)
            self._buffer = None
            # torch's CUDA blocks are 512-byte aligned: past the alignment setDeviceMemoryV2 asks (TensorRT-RTX: 256).
            self._buffer = torch.empty(self.needed, dtype=torch.uint8, device=self.device)
            self.generation += 1
        return self._buffer


def shared_for(artifacts: Iterable[Artifact], device: torch.device | None = None) -> SharedDeviceMemory | None:
    """One buffer for these pipeline members when two or more are TensorRT or TensorRT-RTX plans (wrapped TorchScript
    engines make their own contexts), else None: each runtime keeps TensorRT's default."""
    if sum(a.stage == "build-trt" for a in artifacts) < 2:
        return None
    return SharedDeviceMemory(device or torch.device("cuda", torch.cuda.current_device()))
