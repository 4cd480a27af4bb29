"""Benchmarks: the pipeline's latency broken down by stage, per backend, side by side in one run.

For each backend: load time (engine compile through the store, session creation) and the first,
warm-up runs are reported apart from steady state; each timed repeat is broken into text encoding
(every text encoder: CLIP, CLIP-G, T5), the denoising loop (UNet or transformer calls + scheduler and
guidance) and the VAE decode, from the same spans
`sdtrt profile` shows. Backends that cannot run here are reported as skipped with the reason.

JSON format (stable; other tools read it)::

    {"format": 1, "config": {..., "task", "denoiser": "unet" | "transformer", "inputs": [IMAGE NAME]},
     "environment": {...}, "backends": [
      {"name", "status": "ok" | "skipped" | "failed", "reason", "load_s", "warmup_s",
       "total_s": STATS, "stages_s": {"text_encoder": STATS, "denoise_loop": STATS, "unet": STATS,
       "scheduler_guidance": STATS, "vae_decode": STATS}, "unet_call_ms": STATS, "unet_calls",
       "peak_rss_mb", "peak_gpu_mb", "speedup_vs_first", "noisy", "lora_apply_s", "lora_swap_s": STATS,
       "step_cache": {"cache", "denoiser_calls", "full_evaluations", "skipped_share", "denoise_loop_s": STATS,
                      "cached_denoise_loop_s": STATS, "speedup", "psnr_db", "ssim"} | {"cache", "error"} | null}]}

STATS is {"median", "min", "max"} in seconds (``unet_call_ms`` in milliseconds); the ``unet`` stage
and ``unet_call_ms`` time the model's denoiser, whichever ``config.denoiser`` says it is; speed-ups are
ratios of median totals against the first backend that ran; ``noisy`` is true where the slowest
timed run took over NOISY_RATIO times the fastest (a busy machine: do not read ratios from it).
With LoRAs (``config.loras``), ``lora_apply_s`` is putting them in the first time (engines: weight
maps made or read, base weights read, the new weights swapped in — a refit on TensorRT; PyTorch:
diffusers' load + fuse) and ``lora_swap_s`` each later swap (clear, then the LoRAs again; engines
only); the timed runs generate with the LoRAs in. With a step cache (``config.cache``), ``step_cache`` compares the
cached loop with the uncached one in the same process (tools/step_cache_bench.py): ``full_evaluations`` counts the
steps whose blocks after the first ran on the engines (null on PyTorch), ``skipped_share`` the rest.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

from ..core.config import BenchConfig, ExportConfig, Precision, Range, ShapeProfile, Target, TrtBuildConfig
from ..core.errors import BenchError, one_line
from ..core.stage_request import environment
from ..core.store import Store
from ..pipeline.loading import generate, load_pipeline
from ..pipeline.request import GenerateRequest, SizeRule
from ..pipeline.step_cache import StepCache
from ..sources.models import ModelSource
from ..spec import FOLDERS, denoiser_component, denoiser_spec
from ..tools.timing import Stats, rss_sampler
from ..tools.trace import Tracer, breakdown, instrument_pipeline

STAGES = ("text_encoder", "denoise_loop", "unet", "scheduler_guidance", "vae_decode")
BREAKDOWN_STAGES = ("text_encoder", "unet", "scheduler_guidance", "vae_decode")  # add up to a run: no denoise_loop
FORMAT = 1
# A backend whose slowest timed run took this many times its fastest ran on a busy machine: its
# ratios against other backends are not to be trusted.
NOISY_RATIO = 1.5


@dataclass
class BackendResult:
    name: str
    status: str = "ok"
    reason: str | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    total_s: dict[str, float] | None = None
    stages_s: dict[str, dict[str, float]] = field(default_factory=dict)
    unet_call_ms: dict[str, float] | None = None
    unet_calls: int | None = None
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None
    speedup_vs_first: float | None = None
    noisy: bool = False  # slowest / fastest timed run > NOISY_RATIO
    lora_apply_s: float | None = None
    lora_swap_s: dict[str, float] | None = None
    step_cache: dict[str, Any] | None = None  # with config.cache: tools/step_cache_bench.py's comparison


def denoiser_label(component: str) -> str:
    """How tables name the denoiser the ``unet`` stage times: SD3's and Flux's is a transformer."""
    return "UNet" if component == "unet" else component


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bench_profile(model: ModelSource, config: BenchConfig) -> ShapeProfile:
    """An engine profile around the default that certainly covers the benchmarked shape; the default's tokens,
    guidance and references stay (a Z-Image or Qwen-Image text encoder's token range is no T5's 512)."""
    default = denoiser_spec(model).default_profile()  # the UNet's or the transformer's
    h = config.height or default.height.opt
    w = config.width or default.width.opt
    return dataclasses.replace(
        default,
        batch=Range(1, config.batch, max(config.batch, default.batch.max)),
        height=Range(min(h, default.height.min), h, max(h, default.height.max)),
        width=Range(min(w, default.width.min), w, max(w, default.width.max)),
    )


def load_backend(spec: str, model: ModelSource, config: BenchConfig, store: Store) -> Any:
    """A ready pipeline for one backend spec (compiling its engine through the store if needed)."""
    from ..core.gpu import tensorrt_missing
    from .compile import compile_model

    name, _, precision = spec.partition(":")
    device = _device()
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    if name.startswith("torch"):
        pipe = load_pipeline(model, task=config.task, dtype=dtype).to(
            device
        )  # LoRAs go in (and are timed) after loading
        denoiser = FOLDERS[denoiser_component(model)]  # the pipeline's attribute: unet (a transformer's next)
        if name == "torch-sdpa-off":
            from diffusers.models.attention_processor import AttnProcessor

            getattr(pipe, denoiser).set_attn_processor(AttnProcessor())
        elif name == "torch-compile":
            setattr(pipe, denoiser, torch.compile(getattr(pipe, denoiser)))
        return pipe
    if name == "tensorrt" and (missing := tensorrt_missing()):
        raise _Skip(missing)
    target: Target = "tensorrt" if name == "tensorrt" else "onnxruntime"
    chosen = cast(Precision, precision or config.precision)  # BenchConfig checked it
    export_config = ExportConfig(precision=chosen)
    # compile's default: every component on the engine target, each stage on its engine.
    trt_config = TrtBuildConfig(profiles=(_bench_profile(model, config),), refittable=True) if config.loras else None
    caches = (StepCache.parse(config.cache).kind,) if config.cache else ()
    result = compile_model(
        model, store, target, export_config, profile=_bench_profile(model, config), trt_config=trt_config,
        caches=caches,
    )  # fmt: skip
    return load_pipeline(model, result.final, task=config.task, dtype=dtype).to(device)


def time_loras(pipe: Any, loras: tuple[tuple[str, float], ...], swaps: int) -> tuple[float, dict[str, float] | None]:
    """Seconds to put ``loras`` in the first time, and Stats of ``swaps`` later swaps (clear, then them again)."""
    from ..lora.refit import fuse_loras
    from ..pipeline.loading import set_loras
    from ..standins.adapter_registry import lora_networks

    started = time.perf_counter()
    if not lora_networks(pipe):  # PyTorch: diffusers fuses them, once
        fuse_loras(pipe, loras)
        return time.perf_counter() - started, None
    set_loras(pipe, loras)
    first, timed = time.perf_counter() - started, []
    for _ in range(swaps):
        for each in ((), loras):
            started = time.perf_counter()
            set_loras(pipe, each)
            timed.append(time.perf_counter() - started)
    return first, Stats.of(timed).to_json()


class _Skip(Exception):
    """This backend cannot run on this machine; the message says why."""


def run_backend(
    name: str, model: ModelSource, config: BenchConfig, store: Store, inputs: Mapping[str, Any] | None = None
) -> BackendResult:
    result = BackendResult(name)
    device = _device()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    request = GenerateRequest(
        prompt=config.prompt, steps=config.steps, seed=config.seed, height=config.height, width=config.width,
        guidance=SizeRule.for_model(model).applicable(config.guidance), images=config.batch, **(inputs or {}),
    )  # fmt: skip
    with rss_sampler() as peak_rss:
        try:
            started = time.perf_counter()
            pipe = load_backend(name, model, config, store)
            result.load_s = time.perf_counter() - started
            if config.loras:
                result.lora_apply_s, result.lora_swap_s = time_loras(pipe, config.loras, config.repeats)
            started = time.perf_counter()
            for _ in range(config.warmup):  # torch.compile compiles here, on its first call
                generate(pipe, request, output_type="np")
            result.warmup_s = time.perf_counter() - started
        except _Skip as skip:
            return BackendResult(name, status="skipped", reason=str(skip))
        except Exception as exc:  # one backend failing must not hide the others' results
            return BackendResult(name, status="failed", reason=f"{type(exc).__name__}: {one_line(exc)}")
        runs, unet_calls = [], []
        for _ in range(config.repeats):
            tracer = Tracer(device)
            with instrument_pipeline(pipe, tracer) as steps, tracer.span("pipeline", "pipeline"):
                generate(pipe, request, on_step=steps.step_ended, output_type="np")
            spans = tracer.spans()
            runs.append(breakdown(spans))
            unet_calls += [s.seconds * 1000 for s in spans if s.category == "unet"]
        if config.cache:
            result.step_cache = step_cache_result(pipe, request, config)
        result.peak_rss_mb = peak_rss()
    result.total_s = Stats.of([r["total"] for r in runs]).to_json()
    result.stages_s = {stage: Stats.of([r[stage] for r in runs]).to_json() for stage in STAGES}
    result.unet_call_ms = Stats.of(unet_calls).to_json()
    result.unet_calls = len(unet_calls) // config.repeats
    if device.type == "cuda":
        result.peak_gpu_mb = torch.cuda.max_memory_allocated() / 2**20
    return result


def step_cache_result(pipe: Any, request: GenerateRequest, config: BenchConfig) -> dict[str, Any]:
    """The cached and uncached loops side by side, or why this backend cannot run the cache (PyTorch SD3's class has
    no enable_cache): one backend's refusal must not hide the others' figures."""
    from ..core.errors import EngineInputError
    from .step_cache_bench import compare_step_cache

    assert config.cache is not None
    try:
        return compare_step_cache(pipe, request, StepCache.parse(config.cache), config.repeats)
    except EngineInputError as exc:
        return {"cache": config.cache, "error": one_line(exc)}


def compare(results: list[BackendResult]) -> None:
    """Speed-ups of median totals against the first backend that ran; flag backends whose runs disagree."""
    ran = [(r, r.total_s) for r in results if r.status == "ok" and r.total_s]
    for r, total in ran:
        r.speedup_vs_first = ran[0][1]["median"] / total["median"]
        r.noisy = total["max"] > NOISY_RATIO * total["min"]


def run_bench(
    model: ModelSource,
    config: BenchConfig,
    store: Store,
    on_backend: Callable[[str], None] | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every backend in turn, on this machine, in this process: the side-by-side comparison. ``inputs``: the images
    ``config.task``'s pipeline takes, by GenerateRequest field (``image``, ``mask_image``: PIL images).

    A size no backend could serve is a RequestError, and a LoRA file sdtrt cannot use a LoraError,
    before anything is loaded.
    """
    from ..lora.files import read_lora

    height, width = SizeRule.for_model(model).resolve(config.height, config.width)
    for path, _ in config.loras:
        read_lora(path)
    config = dataclasses.replace(config, height=height, width=width)
    results = []
    for name in config.backends:
        if on_backend:
            on_backend(name)
        results.append(run_backend(name, model, config, store, inputs))
    compare(results)
    env = environment("torch", "diffusers", "onnxruntime", "tensorrt", "torch-tensorrt") | {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    return {
        "format": FORMAT,
        "config": asdict(config)
        | {"model": model.name, "denoiser": denoiser_component(model), "inputs": sorted(inputs or {})},
        "environment": env,
        "backends": [asdict(r) for r in results],
    }


def check_engines_ran(report: dict[str, Any]) -> None:
    """BenchError when engine backends were asked for and every one failed (none merely skipped as unavailable
    here): the run has no engine figures, which were its point, so it must not look like a success."""
    engines = [b for b in report["backends"] if not b["name"].startswith("torch")]
    failed = [b["name"] for b in engines if b["status"] == "failed"]
    if failed and not any(b["status"] == "ok" for b in engines):
        raise BenchError(f"every engine backend failed ({', '.join(failed)}); the reasons are above")


def write_chart(report: dict[str, Any], path: Any) -> None:
    """A horizontal stacked bar per backend: where each backend's median run spends its time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [b for b in report["backends"] if b["status"] == "ok"]
    unet = denoiser_label(report["config"].get("denoiser", "unet"))
    labels = {"text_encoder": "text encoder", "unet": unet, "scheduler_guidance": "scheduler + guidance",
              "vae_decode": "VAE decode"}  # fmt: skip
    parts = [(stage, labels[stage]) for stage in BREAKDOWN_STAGES]
    colors = ["#8e6bb8", "#2f7ed8", "#f7a35c", "#4caf50", "#bbbbbb"]
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.7 * max(1, len(ran))))
    for row, backend in enumerate(ran):
        left = 0.0
        for (key, label), color in zip(parts, colors, strict=False):
            width = backend["stages_s"][key]["median"]
            ax.barh(row, width, left=left, color=color, label=label if row == 0 else None)
            left += width
        other = backend["total_s"]["median"] - left
        if other > 0:
            ax.barh(row, other, left=left, color=colors[-1], label="other" if row == 0 else None)
        ax.text(backend["total_s"]["median"], row, f"  {backend['total_s']['median']:.2f} s", va="center")
    ax.set_yticks(range(len(ran)), [b["name"] for b in ran])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per image (median)")
    cfg = report["config"]
    ax.set_title(f"{cfg['model']}: {cfg['steps']} steps, batch {cfg['batch']}, {report['environment']['device']}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize="small", ncol=5, frameon=False)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
