"""Whether a comparison case fits in host memory, before ONNX Runtime runs it on the CPU (validate's guard)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

from ..core.config import format_size
from ..spec import GraphSpec, ValidationCase


@dataclass
class HostMemory:
    """Whether a comparison case on the CPU fits in memory, projected from the largest case measured before it.

    ONNX Runtime computes attention as MatMul, Softmax, MatMul and holds batch × heads × tokens² scores: SD 1.5's
    largest default case (batch 8 at 768²) needs ~22 GB for one layer's. What a case adds to the process's peak is
    measured, and a larger case is projected by its batch (linearly) and the size of one batch item's inputs (squared,
    as attention over pixels or tokens grows): a bound that overestimates what the convolutions (linear) add. A case
    no larger than one already run is always compared, unless its own inputs alone are over the memory: that is
    checked from their shapes, before any case ran, without allocating them.
    """

    spec: GraphSpec
    budget: int | None  # bytes a case may add; None: what is available when it is about to run
    measured: tuple[float, str, int] | None = None  # the largest case so far: its size, its label, the bytes it added

    def size(self, case: ValidationCase) -> float:
        """batch × positions²: the positions are the elements along the inputs' variable axes other than the batch
        (a UNet's latent pixels, a transformer's image and text tokens); a text encoder, whose 77 tokens are fixed,
        grows with its batch only."""
        shapes = self.shapes(case)
        positions = 0
        for tensor in self.spec.inputs():
            axes = [i for i, axis in enumerate(tensor.shape) if isinstance(axis, str) and axis != "batch"]
            positions += math.prod(shapes[tensor.name][i] for i in axes) if axes else 0
        return case.batch * float(max(positions, 1)) ** 2

    def shapes(self, case: ValidationCase) -> dict[str, tuple[int, ...]]:
        """The case's input shapes (what ``spec.case_inputs`` would allocate)."""
        return self.spec.input_shapes(case.batch, case.height, case.width, case.tokens)

    def input_bytes(self, case: ValidationCase) -> int:
        """What the case's inputs take: case_inputs draws them float32 or int32, 4 bytes an element."""
        return sum(4 * math.prod(shape) for shape in self.shapes(case).values())

    def refusal(self, case: ValidationCase) -> str | None:
        """Why ``case`` is not run (None: it fits)."""
        import psutil

        room = self.budget if self.budget is not None else psutil.virtual_memory().available
        if (inputs := self.input_bytes(case)) > room:
            need = f"its inputs alone take {format_size(inputs)}"
        elif self.measured is None or (size := self.size(case)) <= self.measured[0]:
            return None
        else:
            base, label, added = self.measured
            projected = added * size / base
            if projected <= room:
                return None
            need = (
                f"{label} added {format_size(added)} of host memory, so this case would add "
                f"~{format_size(int(projected))} (ONNX Runtime's attention grows with batch × input size²)"
            )
        if self.budget is not None:
            limit, remedy = "budget", "raise --memory-budget where the machine has the memory"
        else:
            limit, remedy = "available", "compare it on a machine with more memory"
        return f"not compared: {need}, over the {format_size(room)} {limit}; {remedy}"

    @contextlib.contextmanager
    def measuring(self, case: ValidationCase, label: str) -> Iterator[None]:
        import psutil

        from ..tools.timing import rss_sampler

        before = psutil.Process().memory_info().rss
        with rss_sampler() as peak_mb:
            yield
        added, size = max(0, int(peak_mb() * 2**20) - before), self.size(case)
        if self.measured is None or size > self.measured[0]:
            self.measured = (size, label, added)
        elif size == self.measured[0] and added > self.measured[2]:
            self.measured = (size, self.measured[1], added)
