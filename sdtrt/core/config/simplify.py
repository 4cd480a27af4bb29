"""The simplify stage's configuration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from .keys import not_in_key

SimplifyMethod = Literal["auto", "onnxsim", "fold", "stream"]


@dataclass(frozen=True)
class SimplifyConfig:
    """Graph simplification: onnxsim, constant folding + cleanup when onnxsim cannot cope, or ``stream``: a cleanup
    that never loads the weights (big graphs; ``auto`` picks it by the weights' size and the memory budget)."""

    method: SimplifyMethod = "auto"
    # Compare the simplified graph with its input on ONNX Runtime before accepting it.
    check: bool = not_in_key(True)
    check_min_cosine: float = not_in_key(0.9999)
    # Bytes of memory the stage may plan with; None: this machine's physical memory.
    memory_budget: int | None = not_in_key(None)

    def __post_init__(self) -> None:
        if self.method not in ("auto", "onnxsim", "fold", "stream"):
            raise ConfigError(f"simplify method '{self.method}' is not auto, onnxsim, fold or stream")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"memory budget {self.memory_budget} is not a positive number of bytes")

    def budget(self) -> int:
        """The memory budget in bytes: as set, else physical memory (os.sysconf)."""
        return self.memory_budget or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
