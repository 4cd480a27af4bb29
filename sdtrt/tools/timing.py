"""Honest timing: warm-up excluded, device-timed calls, median and spread over repeats; and peak host memory."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .trace import Tracer


@dataclass(frozen=True)
class Stats:
    """Seconds over repeats."""

    median: float
    min: float
    max: float
    samples: int

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        return cls(statistics.median(seconds), min(seconds), max(seconds), len(seconds))

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def to_json(self) -> dict[str, float]:
        return {"median": self.median, "min": self.min, "max": self.max}


def time_calls(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device | str = "cpu") -> Stats:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times, each timed as one span.

    Spans are CUDA events on a GPU (so asynchronous work is counted where it runs), host clock
    readings on the CPU.
    """
    for _ in range(warmup):
        fn()
    tracer = Tracer(device)
    for _ in range(repeats):
        with tracer.span("call"):
            fn()
    return Stats.of([span.seconds for span in tracer.spans()])


@contextmanager
def rss_sampler(interval: float = 0.02) -> Iterator[Callable[[], float]]:
    """Peak resident memory (MB) of this process while the block runs, sampled every ``interval``."""
    import psutil

    process, peak, stop = psutil.Process(), [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss / 2**20)
            stop.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield lambda: peak[0]
    finally:
        stop.set()
        thread.join()
