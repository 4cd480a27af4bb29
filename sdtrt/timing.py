"""Honest timing: warm-up excluded, device-synchronised clocks, median and spread over repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


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


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued device work, so a host clock measures it (no-op on the CPU)."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


class Clock:
    """Elapsed seconds between device-synchronised points (CUDA events on a GPU, perf_counter on CPU)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()

    def start(self) -> Callable[[], float]:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()

            def stop_cuda() -> float:
                end.record()
                end.synchronize()
                return begin.elapsed_time(end) / 1000.0

            return stop_cuda
        started = time.perf_counter()
        return lambda: time.perf_counter() - started


def time_calls(fn: Callable[[], object], warmup: int, repeats: int, device: torch.device | str = "cpu") -> Stats:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` times timed."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    clock = Clock(device)
    seconds = []
    for _ in range(repeats):
        stop = clock.start()
        fn()
        seconds.append(stop())
    return Stats.of(seconds)
