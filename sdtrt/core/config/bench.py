"""What `sdtrt bench` runs: its backends and its configuration."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..families import TASKS, Task
from .precision import PRECISIONS, Precision, target_precision_problem
from .validation import DEFAULT_PROMPT

# Backends `sdtrt bench` knows; the engine backends take a graph precision (onnxruntime:fp32).
BENCH_BACKENDS = ("torch", "torch-sdpa-off", "torch-compile", "onnxruntime", "tensorrt")
ENGINE_BACKENDS = ("onnxruntime", "tensorrt")


@dataclass(frozen=True)
class BenchConfig:
    # Backend names, in order; engine backends may name their graph precision (onnxruntime:fp32).
    backends: tuple[str, ...] = ("torch", "onnxruntime")
    steps: int = 20
    batch: int = 1  # images per prompt; classifier-free guidance doubles the UNet batch
    height: int | None = None  # default: the model's native size
    width: int | None = None
    warmup: int = 1
    repeats: int = 3
    prompt: str = DEFAULT_PROMPT
    guidance: float | None = None  # None: the pipeline's own (diffusers' __call__ default; schnell none)
    seed: int = 0
    precision: Precision = "fp16"  # engines' default; PyTorch runs fp32 on the CPU and fp16 on a GPU
    # (file, scale) LoRAs put into each backend before its runs: how long that and a swap take is reported.
    loras: tuple[tuple[str, float], ...] = ()
    # A step cache (--cache first-block:0.08): each backend also runs it, alternating with uncached runs, and
    # reports both loops, their ratio and the image's PSNR/SSIM against the uncached one (engines: built --caches).
    cache: str | None = None
    # The pipeline of the model's family each backend runs (img2img, inpaint); None: its own. Its images are
    # run_bench's ``inputs``.
    task: Task | None = None

    def __post_init__(self) -> None:
        for spec in self.backends:
            name, _, precision = spec.partition(":")
            if name not in BENCH_BACKENDS:
                raise ConfigError(f"unknown backend '{spec}'; choose from {', '.join(BENCH_BACKENDS)}")
            if precision and (name not in ENGINE_BACKENDS or precision not in PRECISIONS):
                raise ConfigError(
                    f"'{spec}': only {' and '.join(ENGINE_BACKENDS)} take a precision, one of {', '.join(PRECISIONS)}"
                )
            if name in ENGINE_BACKENDS and (problem := target_precision_problem(name, precision or self.precision)):
                raise ConfigError(f"'{spec}': {problem}")
        if self.repeats < 1 or self.warmup < 0 or self.steps < 1:
            raise ConfigError("repeats and steps must be at least 1, warmup at least 0")
        if self.task is not None and self.task not in TASKS:
            raise ConfigError(f"task '{self.task}' is not one of {', '.join(TASKS)}")
