"""What `calibrate-cache` searches for: the most aggressive step-cache setting within a quality target."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .quantize import CALIBRATION_PROMPTS

# The settings tried, from the most cautious to the most aggressive: First-Block Cache's and MagCache's thresholds
# (diffusers' defaults 0.05 and 0.06 among them), TaylorSeer's and DeepCache's full-step intervals.
CACHE_SETTINGS: dict[str, tuple[float, ...]] = {
    "first-block": (0.02, 0.05, 0.08, 0.12, 0.2, 0.3, 0.5, 0.8),
    "magcache": (0.02, 0.06, 0.1, 0.2, 0.4, 0.8),
    "taylorseer": (2, 3, 4, 5, 6, 8),
    "deepcache": (2, 3, 4, 5, 6, 8),
}


@dataclass(frozen=True)
class CacheCalibrationConfig:
    """One search: ``kind``'s settings tried in turn on ``prompts`` (same seed, ``steps`` steps, ``scheduler``),
    each image against the uncached engine pipeline's; the last setting whose worst image keeps ``min_psnr_db``
    wins. The engine set's key is the search's input, so a quantized set gets its own setting."""

    kind: str = "first-block"
    min_psnr_db: float = 30.0
    steps: int = 28
    scheduler: str | None = None
    prompts: tuple[str, ...] = CALIBRATION_PROMPTS[:3]
    height: int | None = None  # None: the engines' profile optimum
    width: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in CACHE_SETTINGS:
            raise ConfigError(f"unknown step cache {self.kind!r}; calibrate-cache searches {', '.join(CACHE_SETTINGS)}")
        if self.steps < 2 or not self.prompts:
            raise ConfigError("calibrate-cache needs at least 2 steps and one prompt")
