"""DeepCache on a UNet engine: the whole UNet every ``cache_interval`` steps, the shallow branch on the steps between.

The ``deepcache`` package (DeepCacheSDHelper) wraps the PyTorch UNet's blocks and returns their cached outputs on the
steps it skips; an engine has no blocks to wrap, so an engine set compiled with ``caches=("deepcache",)`` holds two
more members (spec/unet_split.py): ``unet_deep``, the whole UNet that also hands out the feature entering the cut,
and ``unet_shallow``, the UNet's outer layers, which take that feature back in. Steps are counted as the package
counts them: by the timestep's index in the scheduler's timesteps, from the first one since the cache was enabled,
a full step where ``(index - first) % cache_interval == 0``; so an engine pipeline skips the steps the PyTorch one
skips. Unlike the package, the count starts again at each pipeline call (diffusers' pipelines call
``_reset_stateful_cache`` on their components as they finish; a call cut short is noticed by its index going back).

With DeepCache off the stand-in runs the whole ``unet`` engine, as before: the members cost the uncached path nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..runtime import Runtime
from ..spec.unet_split import DEEP_FEATURE, UNetPartSpec
from .step_cache import PartEngine

Timestep = torch.Tensor | float | int


class SplitUNet:
    """The UNet's two DeepCache engines, fed by canonical names."""

    def __init__(self, parts: dict[str, Runtime]) -> None:
        self.deep = PartEngine(parts["unet_deep"])
        self.shallow = PartEngine(parts["unet_shallow"])
        spec = self.deep.runtime.spec
        assert isinstance(spec, UNetPartSpec)  # the set's manifest says which spec each member has
        self.branch = spec.cache_branch_id  # the one branch these engines were cut at

    def runtimes(self) -> list[Runtime]:
        return [self.deep.runtime, self.shallow.runtime]


def deepcache_problem(split: SplitUNet | None, cache_branch_id: int) -> str | None:
    """Why this engine UNet cannot run DeepCache at ``cache_branch_id``, or None when it can."""
    if split is None:
        return (
            "this engine set has no DeepCache members: recompile it with `sdtrt compile --caches deepcache` (Python: "
            "compile_model(..., caches=('deepcache',)))"
        )
    if cache_branch_id != split.branch:
        return (
            f"these engines were cut at cache_branch_id={split.branch}, not {cache_branch_id}: set_params("
            f"cache_branch_id={split.branch}), the branch `sdtrt compile --caches deepcache` builds"
        )
    return None


class DeepCacheRun:
    """DeepCache's state while it is on: which step is full, and the deep feature the steps between reuse."""

    def __init__(self, split: SplitUNet, cache_interval: int, step_of: Callable[[Timestep], int]) -> None:
        self.split = split
        self.interval = cache_interval
        self.step_of = step_of  # a timestep → its step, as DeepCacheSDHelper counts (pipeline.deepcache)
        self.reset()

    def reset(self) -> None:
        """Forget the last call: the next step is the first of a new one, and full."""
        self.first: int | None = None
        self.last: int | None = None
        self.feature: torch.Tensor | None = None

    def __call__(self, inputs: dict[str, torch.Tensor], timestep: Timestep) -> torch.Tensor:
        """The UNet's output for its canonical inputs: the deep engine's on a full step (keeping its feature), else the
        shallow engine's on the kept feature."""
        step = self.step_of(timestep)
        if self.last is not None and step < self.last:  # a new call, after one that did not finish
            self.reset()
        self.first = step if self.first is None else self.first
        self.last = step
        if (step - self.first) % self.interval == 0:
            out, self.feature = self.split.deep.run(**inputs)
            return out
        assert self.feature is not None  # a call's first step is full
        return self.split.shallow.run(**inputs, **{DEEP_FEATURE: self.feature})[0]
