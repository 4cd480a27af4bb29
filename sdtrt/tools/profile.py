"""Profiling one generation: a waterfall of named spans, a flame graph, and a per-step table.

Outputs in the chosen folder:
- ``trace.json``: Chrome trace / Perfetto (complete events, nested by time) of the pipeline
  stages sdtrt knows and every ``--trace`` function; open it in ui.perfetto.dev or chrome://tracing.
- ``flame.speedscope.json``: a sampling profile of the whole run (pyinstrument), for speedscope.app.
- ``steps.json``: per denoising step: timestep, seconds, UNet seconds, host–device syncs, outlier flag.
On a GPU every span is also an NVTX range, so Nsight Systems shows the same names.
"""

from __future__ import annotations

import json
import statistics
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.artifact import Artifact
from ..core.families import Task
from ..pipeline.loading import generate, load_pipeline
from ..pipeline.request import GenerateRequest, SizeRule
from ..sources.models import ModelSource
from ..tools.trace import Span, Tracer, instrument_pipeline, trace_qualified

OUTLIER_FACTOR = 1.5


@dataclass(frozen=True)
class StepRow:
    index: int
    timestep: float | None
    seconds: float
    unet_seconds: float
    syncs: int | None  # None where the device cannot report them (the CPU)
    outlier: bool


@dataclass(frozen=True)
class ProfileResult:
    trace: Path
    flame: Path
    steps_file: Path
    steps: list[StepRow]
    spans: list[Span]


def chrome_trace(spans: list[Span], metadata: dict[str, Any]) -> dict[str, Any]:
    """Complete ("X") events in microseconds on one thread: viewers nest them by time."""
    events: list[dict[str, Any]] = [
        {"name": s.name, "cat": s.category, "ph": "X", "ts": round(s.start * 1e6, 3), "dur": round(s.seconds * 1e6, 3)}
        | {"pid": 1, "tid": 1, "args": s.args}
        for s in spans
    ]
    events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "sdtrt pipeline"}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def step_rows(spans: list[Span], syncs: list[int] | None) -> list[StepRow]:
    steps = [s for s in spans if s.category == "step"]
    unets = [s for s in spans if s.category == "unet"]
    median = statistics.median(s.seconds for s in steps) if steps else 0.0
    rows = []
    for i, step in enumerate(steps):
        unet = sum(u.seconds for u in unets if step.start <= u.start and u.end <= step.end)
        rows.append(StepRow(
            index=step.args.get("index", i), timestep=step.args.get("timestep"), seconds=step.seconds,
            unet_seconds=unet, syncs=syncs[i] if syncs is not None and i < len(syncs) else None,
            outlier=median > 0 and step.seconds > OUTLIER_FACTOR * median,
        ))  # fmt: skip
    return rows


@contextmanager
def count_syncs(cuda: bool) -> Iterator[list[Any] | None]:
    """On CUDA, torch reports each synchronising operation as a warning; collect them."""
    if not cuda:
        yield None
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def profile_generation(
    model: ModelSource,
    engine: Artifact | None,
    out_dir: Path,
    request: GenerateRequest,
    traces: tuple[str, ...] = (),
    scheduler: str | None = None,
    warmup: int = 0,
    task: Task | None = None,
) -> ProfileResult:
    """Run one generation (after ``warmup`` untraced ones) under the tracer and a sampling profiler; ``task``: the
    pipeline of the model's family to run (img2img, inpaint: the request carries its images), None its own."""
    from pyinstrument import Profiler
    from pyinstrument.renderers import SpeedscopeRenderer

    request = request.sized_for(SizeRule.for_model(model))  # a bad size fails before anything loads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    pipe = load_pipeline(model, engine, scheduler=scheduler, task=task, dtype=dtype).to(device)
    for _ in range(warmup):
        generate(pipe, request, output_type="np")

    tracer = Tracer(device)
    sync_marks: list[int] = []
    profiler = Profiler(interval=0.001)
    with (
        count_syncs(tracer.cuda) as caught,
        trace_qualified(tracer, list(traces)),
        instrument_pipeline(pipe, tracer) as steps,
    ):

        def on_step(index: int, total: int) -> None:
            steps.step_ended(index, total)
            if caught is not None:
                sync_marks.append(len(caught))

        profiler.start()
        try:
            with tracer.span("pipeline", "pipeline", prompt=request.prompt, steps=request.steps):
                generate(pipe, request, on_step=on_step, output_type="np")
        finally:  # a sampler left running prints "Exception ignored … Traceback" on every later call
            profiler.stop()
    spans = tracer.spans()
    syncs = [b - a for a, b in zip([0, *sync_marks], sync_marks, strict=False)] if caught is not None else None

    out_dir.mkdir(parents=True, exist_ok=True)
    rows = step_rows(spans, syncs)
    metadata = {"model": model.name, "engine": str(engine.path) if engine else None, "device": str(device)}
    trace_path, flame_path, steps_path = (
        out_dir / "trace.json",
        out_dir / "flame.speedscope.json",
        out_dir / "steps.json",
    )
    trace_path.write_text(json.dumps(chrome_trace(spans, metadata)))
    flame_path.write_text(profiler.output(renderer=SpeedscopeRenderer()))
    steps_path.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return ProfileResult(trace_path, flame_path, steps_path, rows, spans)
