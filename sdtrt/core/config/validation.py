"""What `validate` compares and how strictly."""

from __future__ import annotations

from dataclasses import dataclass

from .keys import not_in_key
from .sizes import WeightBudget

DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"


@dataclass(frozen=True)
class ValidationConfig:
    """What `validate` compares and how strictly; tolerances left None follow the engine's precision."""

    prompt: str = DEFAULT_PROMPT
    steps: int = 10
    guidance: float | None = None  # None: the pipeline's own (diffusers' __call__ default; schnell none)
    seed: int = 0
    scheduler: str | None = None
    images: bool = True
    height: int | None = None  # image comparison size; None: the engine profile's optimum
    width: int | None = None
    min_cosine: float | None = None
    max_abs: float | None = None
    min_psnr_db: float | None = None
    # GPU memory for the weights of engines built with weight streaming: where weights live, not what they compute.
    weight_budget: WeightBudget | None = not_in_key(None)
    # Host memory a comparison on the CPU may add; None: what is available when it runs. A case projected over it
    # is skipped and reported (ONNX Runtime's attention holds batch × heads × tokens² scores).
    memory_budget: int | None = not_in_key(None)
