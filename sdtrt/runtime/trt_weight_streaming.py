"""TensorRT weight streaming: the budget of an engine built with it, set before its execution context exists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.config import WeightBudget
from ..core.errors import ArtifactError, ConfigError

if TYPE_CHECKING:
    import tensorrt as trt


def weight_budget_bytes(
    budget: WeightBudget, streamable: int, automatic: Callable[[], int], free: Callable[[], int]
) -> int:
    """The bytes of streamable weights to keep on the GPU for ``budget``; ``automatic`` asks TensorRT, ``free`` the
    GPU (its free bytes, read right after)."""
    if budget.percent is not None:
        return int(budget.percent / 100 * streamable)  # as demo/Diffusion's Engine.load computes a percentage
    if budget.size is not None:
        return budget.size
    return untruncated_automatic_budget(automatic(), streamable, free())


INT32_VALUES = 1 << 32


def untruncated_automatic_budget(low_bits: int, streamable: int, free: int) -> int:
    """TensorRT's automatic budget from the 32 bits its Python binding keeps of it and the GPU's ``free`` bytes.

    pyCore.cpp (TensorRT 10.1 to 11.1) binds get_weight_streaming_automatic_budget as
    ``[](ICudaEngine& self) -> int32_t { return self.getWeightStreamingAutomaticBudget(); }`` over an int64_t
    call, so a budget of 2 GiB or more comes back negative or as a smaller positive number: the budget is one of the
    values from 0 to ``streamable`` with these low bits, 4 GiB apart (NvInferRuntime.h getWeightStreamingAutomatic
    Budget caps it at getStreamableWeightsSize()). The same header says the budget "is close to the current free
    memory size, leaving some space for other memory needs", so of several values it is the largest one at or under
    the free memory. With none there, there is no telling which, and the budget is refused rather than guessed.
    """
    fits = range(low_bits % INT32_VALUES, streamable + 1, INT32_VALUES)
    if len(fits) == 1:
        return fits[0]
    if under := [b for b in fits if b <= free]:
        return under[-1]
    raise ConfigError(
        f"TensorRT's automatic weight streaming budget comes through its Python binding as 32 bits ({low_bits}), "
        f"which fit {len(fits)} budgets for {streamable} bytes of streamable weights, none of them within the GPU's "
        f"{free} free bytes; give --weight-streaming-budget as a percentage or a size instead"
    )


def set_weight_budget(engine: trt.ICudaEngine, budget: WeightBudget, plan: Path, rebuild: str) -> None:
    """Limit the GPU memory the engine's weights take, before any execution context exists.

    NvInferRuntime.h setWeightStreamingBudgetV2: non-negative; 0 streams the most, getStreamableWeightsSize() or
    more (the default) streams nothing; needs BuilderFlag::kWEIGHT_STREAMING at build (getStreamableWeightsSize()
    is 0 otherwise), on a strongly typed network (developer guide, "Weight Streaming"); cannot change while
    execution contexts are active; returns false for an invalid budget. The Python property's setter drops that
    bool (pyCore.cpp ``.def_property("weight_streaming_budget_v2", &ICudaEngine::getWeightStreamingBudgetV2,
    &ICudaEngine::setWeightStreamingBudgetV2)``: Python ignores a setter's result), so the budget is read back, as
    Polygraphy's TrtRunner._set_weight_streaming_budget_v2 does. The deprecated V1 property (weight_streaming_budget,
    where -1 and 0 meant "off" and "automatic") is never touched: mixing V1 and V2 is undefined (NvInferRuntime.h).
    """
    streamable = int(engine.streamable_weights_size)
    if streamable == 0:
        raise ArtifactError(
            f"{plan} was built without weight streaming, so it takes no --weight-streaming-budget; rebuild it with "
            f"`{rebuild} --weight-streaming`, or leave the budget out"
        )
    # torch.cuda.mem_get_info is cudaMemGetInfo: the free memory TensorRT's automatic budget is close under.
    automatic, free = engine.get_weight_streaming_automatic_budget, lambda: torch.cuda.mem_get_info()[0]
    wanted = weight_budget_bytes(budget, streamable, automatic, free)
    engine.weight_streaming_budget_v2 = wanted
    if (held := int(engine.weight_streaming_budget_v2)) not in (wanted, min(wanted, streamable)):
        raise ConfigError(
            f"TensorRT did not take the weight streaming budget {budget.text} ({wanted} bytes; it holds {held}) for "
            f"{plan}, whose streamable weights are {streamable} bytes; give a budget from 0 to {streamable} bytes"
        )
