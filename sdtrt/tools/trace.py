"""Spans around named functions, without editing their code: the one mechanism behind bench and profile.

A Tracer records (name, start, end) spans. On a GPU each boundary is a CUDA event, read once after
the run, so tracing adds no host-device synchronisation; each span is also an NVTX range for
Nsight Systems. On the CPU, boundaries are ``perf_counter`` readings.

``instrument_pipeline`` wraps a diffusers pipeline's text encoder, UNet, scheduler step and VAE
decode in spans and opens one span per denoising step; ``trace_qualified`` wraps any importable
function or method by its dotted name (``pkg.module.Class.method``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.config import TEXT_ENCODERS
from ..core.errors import ConfigError


@dataclass
class Span:
    name: str
    category: str
    start: float  # seconds since the tracer's origin
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class _Mark:
    """A point in time: a CUDA event on a GPU, a perf_counter reading on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.host = time.perf_counter()

    def seconds_since(self, origin: _Mark) -> float:
        if self.event is not None and origin.event is not None:
            return origin.event.elapsed_time(self.event) / 1000.0
        return self.host - origin.host


@dataclass(frozen=True)
class _OpenSpan:
    name: str
    category: str
    start: _Mark
    args: dict[str, Any]


class Tracer:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._origin = _Mark(self.cuda)
        self._closed: list[tuple[_OpenSpan, _Mark]] = []

    def begin(self, name: str, category: str = "sdtrt", **args: Any) -> _OpenSpan:
        if self.cuda:
            torch.cuda.nvtx.range_push(name)
        return _OpenSpan(name, category, _Mark(self.cuda), args)

    def end(self, span: _OpenSpan) -> None:
        self._closed.append((span, _Mark(self.cuda)))
        if self.cuda:
            torch.cuda.nvtx.range_pop()

    @contextlib.contextmanager
    def span(self, name: str, category: str = "sdtrt", **args: Any) -> Iterator[None]:
        opened = self.begin(name, category, **args)
        try:
            yield
        finally:
            self.end(opened)

    def spans(self) -> list[Span]:
        """Every closed span, in start order (waits for the device once, on a GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
        spans = [
            Span(o.name, o.category, o.start.seconds_since(self._origin), end.seconds_since(self._origin), o.args)
            for o, end in self._closed
        ]
        return sorted(spans, key=lambda s: (s.start, -s.end))

    def wrap(self, fn: Callable[..., Any], name: str, category: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            with self.span(name, category):
                return fn(*args, **kwargs)

        return traced


@contextlib.contextmanager
def patched(owner: Any, attribute: str, replacement: Any) -> Iterator[None]:
    """Set ``owner.attribute`` for the duration, restoring exactly what was there (also on error)."""
    had_own = attribute in vars(owner) if hasattr(owner, "__dict__") else False
    original = inspect.getattr_static(owner, attribute)
    setattr(owner, attribute, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)


def resolve_qualified(name: str) -> tuple[Any, str]:
    """``pkg.module.Class.method`` → (the object that owns the attribute, the attribute's name)."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:-1]:
                owner = getattr(owner, part)
            if hasattr(owner, parts[-1]):
                return owner, parts[-1]
        except AttributeError:
            pass
        break
    raise ConfigError(f"cannot trace '{name}': no importable module, class and attribute by that name")


@contextlib.contextmanager
def trace_qualified(tracer: Tracer, names: list[str]) -> Iterator[None]:
    """Wrap each named function or method (for every instance, when it is a method) in spans."""
    with contextlib.ExitStack() as stack:
        for name in names:
            owner, attribute = resolve_qualified(name)
            raw = inspect.getattr_static(owner, attribute)
            if isinstance(raw, staticmethod | classmethod):
                wrapped: Any = type(raw)(tracer.wrap(raw.__func__, name, "traced"))
            else:
                wrapped = tracer.wrap(raw, name, "traced")
            stack.enter_context(patched(owner, attribute, wrapped))
        yield


class StepSpans:
    """Opens 'step i' at the first UNet call of a denoising step and closes it when the step ends."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._open: _OpenSpan | None = None
        self._index = 0

    def unet_starting(self, timestep: Any) -> None:
        if self._open is None:
            t = float(torch.as_tensor(timestep).flatten()[0]) if timestep is not None else None
            self._open = self.tracer.begin(f"step {self._index}", "step", index=self._index, timestep=t)

    def step_ended(self, index: int, total: int) -> None:
        if self._open is not None:
            self.tracer.end(self._open)
            self._open = None
        self._index = index + 1


@contextlib.contextmanager
def instrument_pipeline(pipe: Any, tracer: Tracer) -> Iterator[StepSpans]:
    """Spans for the pipeline's text encoders, denoiser (UNet or transformer) calls, scheduler steps and VAE decodes.

    Instance attributes are patched (the pipeline's own objects only) and restored on exit. Pass
    the yielded ``StepSpans.step_ended`` as ``generate(on_step=…)`` to get per-step spans.
    """
    steps = StepSpans(tracer)
    # The denoiser: a UNet (called with sample, timestep positionally) or SD3's / Flux's transformer (by keyword).
    denoiser = pipe.unet if getattr(pipe, "transformer", None) is None else pipe.transformer
    denoiser_forward = denoiser.forward

    def traced_unet(*args: Any, **kwargs: Any) -> Any:
        steps.unet_starting(kwargs["timestep"] if "timestep" in kwargs else args[1])
        with tracer.span("unet", "unet"):
            return denoiser_forward(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(denoiser, "forward", traced_unet))
        # Every text encoder (SDXL's CLIP-G, SD3's and Flux's T5) is a span of the "text_encoder" stage.
        for name in TEXT_ENCODERS:
            if (encoder := getattr(pipe, name, None)) is not None:
                stack.enter_context(patched(encoder, "forward", tracer.wrap(encoder.forward, name, "text_encoder")))
        stack.enter_context(
            patched(pipe.scheduler, "step", tracer.wrap(pipe.scheduler.step, "scheduler.step", "scheduler"))
        )
        stack.enter_context(patched(pipe.vae, "decode", tracer.wrap(pipe.vae.decode, "vae_decode", "vae")))
        yield steps


def breakdown(spans: list[Span]) -> dict[str, float]:
    """One run's seconds per stage, from its spans (the pipeline span is the total)."""
    by_name: dict[str, list[Span]] = {}
    for span in spans:
        by_name.setdefault(span.category, []).append(span)
    steps = by_name.get("step", [])
    loop = steps[-1].end - steps[0].start if steps else 0.0
    unet = sum(s.seconds for s in by_name.get("unet", []))
    return {
        "total": sum(s.seconds for s in by_name.get("pipeline", [])),
        "text_encoder": sum(s.seconds for s in by_name.get("text_encoder", [])),
        "denoise_loop": loop,
        "unet": unet,
        "scheduler_guidance": loop - unet,
        "vae_decode": sum(s.seconds for s in by_name.get("vae", [])),
    }
