"""The graph contract of a FreeU-capable UNet: the whole UNet, plus FreeU's four factors as an input.

diffusers' FreeU (``unet.enable_freeu(s1, s2, b1, b2)``) rescales features inside the UNet's first two up blocks, so
an engine of the plain UNet cannot run it. An engine set compiled with ``freeu=True`` (``sdtrt compile --freeu``)
holds the UNet once more as ``unet_freeu``, which takes the factors as a ``freeu`` tensor [s1, s2, b1, b2] (fp32,
whatever the graph's precision, as the factors are Python floats in diffusers): the plain ``unet`` engine stays what
it was, and runs whenever FreeU is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.config import Component
from .unet import UNetSpec

FREEU = "freeu"
FACTORS = ("s1", "s2", "b1", "b2")  # the input's order: enable_freeu's
# What validation feeds the factors: FreeU's recommended values for SD 1.x and SDXL (github.com/ChenyangSi/FreeU),
# not random numbers, so the graph is checked where it is used.
VALIDATION_FACTORS = (0.9, 0.2, 1.3, 1.4)


@dataclass(frozen=True)
class UNetFreeUSpec(UNetSpec):
    """The whole UNet with FreeU applied, its factors the last input."""

    component: ClassVar[Component] = "unet_freeu"
    label: ClassVar[str] = "UNet with FreeU"

    def extra_tensors(self) -> list[tuple[str, tuple[int | str, ...]]]:
        return [*super().extra_tensors(), (FREEU, (len(FACTORS),))]

    def fixed_inputs(self) -> dict[str, tuple[float, ...]]:
        return super().fixed_inputs() | {FREEU: VALIDATION_FACTORS}
