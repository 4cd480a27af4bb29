"""``sdtrt.DeepCache``: DeepCache on an engine pipeline, with the calls of the ``deepcache`` package's helper.

    helper = sdtrt.DeepCache(pipe)  # as DeepCacheSDHelper(pipe)
    helper.set_params(cache_interval=3, cache_branch_id=0)
    helper.enable()
    image = pipe(prompt).images[0]
    helper.disable()  # back to the whole UNet engine: the uncached images, bit for bit

The pipeline's UNet must come from an engine set compiled with ``caches=("deepcache",)`` (``sdtrt compile --caches
deepcache``); the engines skip the steps the package skips on the PyTorch UNet (standins/deepcache.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.errors import EngineInputError
from ..standins.deepcache import Timestep
from ..standins.unet import EngineUNet

SKIP_MODES = ("uniform",)  # DeepCacheSDHelper accepts others, but its step rule implements this one only


class DeepCache:
    """DeepCacheSDHelper's API over an engine pipeline's UNet: ``set_params``, ``enable``, ``disable``."""

    def __init__(self, pipe: Any = None) -> None:
        self.pipe = pipe
        self.set_params()

    def set_params(self, cache_interval: int = 1, cache_branch_id: int = 0, skip_mode: str = "uniform") -> None:
        """A full UNet step every ``cache_interval`` steps; the steps between reuse the deep feature at
        ``cache_branch_id`` (the one branch the engines were cut at: 0). Takes effect at the next ``enable``."""
        if skip_mode not in SKIP_MODES:
            raise EngineInputError(
                f"DeepCache: skip_mode {skip_mode!r} is not one DeepCacheSDHelper runs; use 'uniform' (a full step "
                "every cache_interval steps)"
            )
        if cache_interval < 1:
            raise EngineInputError(f"DeepCache: cache_interval {cache_interval} must be 1 or more (1: no step skips)")
        self.params: dict[str, Any] = {
            "cache_interval": cache_interval,
            "cache_branch_id": cache_branch_id,
            "skip_mode": skip_mode,
        }

    def enable(self, pipe: Any = None) -> None:
        """Run the pipeline's UNet steps through DeepCache (EngineInputError, in one line, where they cannot)."""
        self.pipe = pipe if pipe is not None else self.pipe
        self._unet().enable_deepcache(self.params["cache_interval"], self.params["cache_branch_id"], self._step_of)

    def disable(self) -> None:
        """Every step on the whole UNet engine again."""
        self._unet().disable_deepcache()

    def _unet(self) -> EngineUNet:
        unet = getattr(self.pipe, "unet", None)
        if isinstance(unet, EngineUNet):
            return unet
        if self.pipe is None:
            raise EngineInputError("DeepCache needs the pipeline it runs on: DeepCache(pipe)")
        if unet is None:
            raise EngineInputError(
                f"DeepCache caches a UNet's deep features, and {type(self.pipe).__name__} has none: on a transformer "
                "use pipe.transformer.enable_cache(FirstBlockCacheConfig(...)) (sdtrt compile --caches first-block)"
            )
        raise EngineInputError(
            "DeepCache: this pipeline's UNet runs on PyTorch, not an engine: load the pipeline with an engine set "
            "compiled with `sdtrt compile --caches deepcache`, or use the deepcache package's DeepCacheSDHelper"
        )

    def _step_of(self, timestep: Timestep) -> int:
        """The timestep's step, as DeepCacheSDHelper counts steps: its first index in the scheduler's timesteps (a
        timestep the scheduler repeats, as PNDM repeats its second, is the same step both times)."""
        t = torch.as_tensor(timestep).flatten()[0].item()
        found = (torch.as_tensor(self.pipe.scheduler.timesteps) == t).nonzero()
        if not len(found):
            raise EngineInputError(
                f"DeepCache counts steps by the scheduler's timesteps, and the UNet was called at t={t:g}, which is "
                "not among them: call the UNet through the pipeline"
            )
        return int(found[0])
