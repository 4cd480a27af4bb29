"""Build stage, TensorRT targets: ONNX → serialized engine (``{component}.plan``), in a child process.

A datacenter TensorRT engine is specific to the TensorRT version and the GPU's compute capability, so both enter
the cache key and the manifest; the runtime refuses an engine built for anything else. A TensorRT-RTX plan is built
without a GPU for a set of compute capabilities (``--compute-capability``, or TensorRT-RTX's default), which enter the
key and manifest with the TensorRT-RTX version (sdtrt/core/trt_products.py names how the two differ).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.artifact import Artifact
from ..core.config import TrtBuildConfig, default_optimization_level
from ..core.errors import BuildError, ConfigError, MissingDependencyError
from ..core.gpu import (
    capability_version,
    gpu_environment,
    quantization_problem,
    require_quantization_support,
    require_refit_support,
    require_tensorrt,
    tensorrt_version,
)
from ..core.progress import step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..core.trt_products import (
    DEFAULT_COMPUTE_CAPABILITIES,
    RTX_DEFAULT_CAPABILITIES,
    TENSORRT_RTX,
    Product,
    gpu_only_problem,
    load,
    product,
    rtx_missing,
    rtx_turing_problem,
)
from .quantize import quantization, quantized_from, tensorrt_graph, tensorrt_spec
from .trt_build_worker import REFUSED_EXIT, layer_summary

STAGE = "build-trt"
VERSION = 2  # 2: the plan is named after its component (settings added since enter the key only when set)
LOG_NAME = "build.log"


def run(config: TrtBuildConfig, source: Artifact, store: Store) -> Artifact:
    if config.strip_weights and source.stage == "external":
        raise ConfigError(
            f"--strip-weights refills the plan from its graph at every load, so the graph must be a store artifact "
            f"whose file digests the load can check, and {source.primary} is outside the store; put it through "
            f"`sdtrt simplify {source.primary}` first, or build without --strip-weights"
        )
    precision = quantization(source)
    if config.strip_weights and (made_from := quantized_from(source)):
        # A quantized plan is built from the quantize stage's TensorRT graph, not from the artifact's own primary
        # graph that a stripped plan is refilled from: the refit could not promise the build's weights.
        quantized = made_from.manifest["config"]["precision"]
        raise ConfigError(f"--strip-weights is not offered for {quantized} engines yet; build without it")
    if config.strip_weights:  # the plan needs its graph at every load: `gc --older-than` must see it used now
        source.mark_used()
    spec = tensorrt_spec(source)
    which = product(config.product)
    env = build_environment(which, config, spec.precision, precision)
    for profile in config.effective_profiles():
        spec.check_profile(profile)
    config, level_reason = resolved(config, source)  # the key and manifest say what was built
    request = stage_request(config, source, env)
    artifact, _ = store.produce(request, lambda out_dir: _build(config, source, out_dir, store, level_reason))
    return artifact


def build_environment(which: Product, config: TrtBuildConfig, graph_precision: str, quantized: str | None) -> dict:
    """What keys the plan beyond its config, once this machine is known to build it: the datacenter TensorRT's version
    and the GPU it builds on (which must run the graph's precision); TensorRT-RTX's version (each compute capability
    asked for must run it too). trt.__version__, not a distribution's: with only tensorrt-cu12/-cu13 installed there
    is no `tensorrt` distribution, and the runtime compares against trt.__version__."""
    if which is TENSORRT_RTX:
        if missing := rtx_missing():
            raise MissingDependencyError(f"cannot build a TensorRT-RTX plan: {missing}")
        if problem := gpu_only_problem(which, config.refittable, config.strip_weights):
            raise MissingDependencyError(problem)
        if problem := rtx_turing_problem(graph_precision, config.compute_capabilities):
            raise ConfigError(f"cannot build this TensorRT-RTX plan: {problem}")
        for capability in config.compute_capabilities:
            gpu = f"compute capability {capability}"
            problem = graph_precision_problem(graph_precision, capability, gpu) or (
                quantization_problem(quantized, capability, gpu) if quantized else None
            )
            if problem:
                raise ConfigError(f"cannot build this TensorRT-RTX plan for {capability}: {problem}")
        return environment("torch") | {"tensorrt-rtx": str(load(which).__version__)}
    require_tensorrt()
    if config.refittable:  # before any work: TensorRT 11.3's REFIT engines may lose GEMM biases
        require_refit_support()
    if quantized:  # before any work: an FP8 plan on an Ampere GPU cannot be built
        require_quantization_support(quantized)
    require_graph_precision(graph_precision)  # a quantized Flux's is bf16
    return environment("torch") | {"tensorrt": tensorrt_version()} | gpu_environment()


# BF16 runs from Ampere on (NvInfer.h BuilderFlag::kBF16: "only supported by NVIDIA Ampere and later GPUs"); a strongly
# typed bf16 graph has no fp32 fallback to take elsewhere.
BF16_MIN_CAPABILITY = (8, 0)


def graph_precision_problem(precision: str, compute_capability: str, gpu: str = "this GPU") -> str | None:
    """Why a GPU of ``compute_capability`` ("7.5") cannot run a graph of ``precision``, or None when it can: a bf16
    graph needs Ampere. A quantized Flux's TensorRT graph is bf16 too (quantize.tensorrt_precision), so INT8, which
    Turing runs (gpu.quantization_problem), does not make a Flux engine buildable there."""
    if precision != "bf16" or capability_version(compute_capability) >= BF16_MIN_CAPABILITY:
        return None
    return (
        f"bf16 graphs need a GPU of compute capability 8.0 or newer (Ampere), and {gpu} has {compute_capability}; "
        "export in fp16 (or quantize a UNet), or build on a newer GPU"
    )


def require_graph_precision(precision: str) -> None:
    """MissingDependencyError when the current GPU cannot build a TensorRT graph of ``precision``; compile calls it
    before exporting or calibrating, build before building."""
    if problem := graph_precision_problem(precision, **gpu_environment()):
        raise MissingDependencyError(f"cannot build this TensorRT engine here: {problem}")


def stage_request(config: TrtBuildConfig, source: Artifact, env: dict[str, str]) -> StageRequest:
    """What keys the plan. A stripped plan is keyed by its graph's content too: a graph made again with other bytes
    under the same key (a non-deterministic export after `cache gc`) gets a new plan, never one that is refilled
    with weights it was not built with."""
    from ..runtime.trt_refill import graph_digest

    refill = [{"kind": "refill-graph", "digest": graph_digest(source)}] if config.strip_weights else []
    return StageRequest(STAGE, VERSION, config, [source.as_input(), *refill], env)


def refill_record(source: Artifact) -> dict[str, Any]:
    """The manifest's word that a plan holds no weights, and which graph refills them at load (with its digest)."""
    from ..runtime.trt_refill import graph_digest

    files = sorted(f["name"] for f in source.manifest.get("files", []))  # the graph and its external data
    return {
        "in_plan": False,
        "refill_from": {
            "artifact": str(source.path.resolve()),  # the default store, ./engines, is relative to where it ran
            "graph": source.primary.name,
            "files": files,
            "digest": graph_digest(source),
        },
    }


def parameter_count(graph: Path) -> int:
    """How many weights the graph holds: its initializers' elements, read from the graph without its weights."""
    import math

    from ..graph.onnx_graph import load_graph

    return sum(math.prod(init.dims) for init in load_graph(graph).graph.initializer)


def resolved(config: TrtBuildConfig, source: Artifact) -> tuple[TrtBuildConfig, str]:
    """The settings as built: TF32 by the precision of the graph TensorRT builds (a quantized one's is 16-bit), the
    optimization level (unless asked) by whether it is quantized and a Flux transformer (default_optimization_level);
    and why that level."""
    tf32 = config.tf32_for(tensorrt_spec(source).precision)
    if not product(config.product).optimization_level:
        config = replace(config, tf32=tf32, compute_capabilities=runnable_capabilities(config, source))
        return config, "none: TensorRT-RTX does no autotuning at build time (sdtrt/core/trt_products.py)"
    if config.optimization_level is not None:
        return replace(config, tf32=tf32), f"level {config.optimization_level}: asked for"
    parameters, architecture = parameter_count(tensorrt_graph(source)), tensorrt_spec(source).architecture
    level, reason = default_optimization_level(parameters, quantization(source), architecture)
    return replace(config, tf32=tf32, optimization_level=level), reason


def last_error(log: Path) -> str:
    """The last error TensorRT logged ("[TRT] [E] ..."), in one line and short, or "" when it logged none."""
    errors = [line.split("[E]", 1)[1].strip() for line in log.read_text(errors="replace").splitlines() if "[E]" in line]
    return " ".join(errors[-1].split())[:400] if errors else ""


def runnable_capabilities(config: TrtBuildConfig, source: Artifact) -> tuple[str, ...]:
    """The compute capabilities a TensorRT-RTX plan is built for: those asked for; else TensorRT-RTX's default set
    (8.0 and later), narrowed for a Q/DQ graph to the GPUs with its 8-bit Tensor Cores (FP8: 8.9 and later), so that
    an 8.0 or 8.6 GPU never loads an FP8 plan it cannot run. The narrowed set enters the key and the manifest."""
    quantized = quantization(source)
    if config.compute_capabilities or not quantized:
        return config.compute_capabilities
    runnable = tuple(c for c in RTX_DEFAULT_CAPABILITIES if quantization_problem(quantized, c) is None)
    return () if runnable == RTX_DEFAULT_CAPABILITIES else runnable


def worker_request(config: TrtBuildConfig, source: Artifact, out_dir: Path, device: int = 0) -> dict[str, Any]:
    """The JSON the child process gets: paths, settings, per-input (min, opt, max) shapes and the CUDA device
    whose GPU the manifest records (the current one here; the child would otherwise build on device 0), and for a
    Q/DQ graph its 8-bit format, which the child checks the parsed network for, as it checks for layers of the graph's
    precision; the product, and for TensorRT-RTX the compute capabilities to build for."""
    spec = tensorrt_spec(source)
    config, _ = resolved(config, source)
    plan = f"{spec.component}.plan"
    workspace = int(config.workspace_gb * (1 << 30)) if config.workspace_gb else 0
    return {
        "onnx": str(tensorrt_graph(source)),
        "quantization": quantization(source),
        "plan": str(out_dir / plan),
        "result": str(out_dir / "result.json"),
        "profiles": [
            {name: [list(s) for s in shapes] for name, shapes in spec.profile_shapes(p).items()}
            for p in config.effective_profiles()
        ],
        "optimization_level": config.optimization_level,
        "workspace_bytes": workspace,
        "timing_cache": config.timing_cache,
        "refittable": config.refittable,
        "tf32": config.tf32,
        "weight_streaming": config.weight_streaming,
        "strip_weights": config.strip_weights,
        "device": device,
        "product": config.product,
        "precision": spec.precision,
        "compute_capabilities": list(config.compute_capabilities),
    }


def built_with_tf32(manifest: dict[str, Any]) -> bool:
    """Whether this engine's fp32 layers compute in TF32: its config says, and engines built before sdtrt
    set the flag kept TensorRT's default, on."""
    tf32 = manifest.get("config", {}).get("tf32")
    return True if tf32 is None else bool(tf32)


def reproduce_command(config: TrtBuildConfig, source: Path) -> str:
    """`sdtrt build` with every setting of this engine: what a rebuild must repeat (several profiles: the first,
    as the CLI takes one). Shell-quoted: users paste it."""
    profile = config.profiles[0]
    words = [f"sdtrt build {shlex.quote(str(source))} --target {config.product}"]
    words += [f"--batch {profile.batch}", f"--height {profile.height}", f"--width {profile.width}"]
    words += [f"--tokens {profile.tokens}"] if profile.tokens else []
    words += [] if config.optimization_level is None else [f"--optimization-level {config.optimization_level}"]
    words += ["--static"] if config.static_shapes else []
    words += [f"--workspace-gb {config.workspace_gb}"] if config.workspace_gb else []
    words += ["--refittable"] if config.refittable else []
    words += [] if config.tf32 is None else ["--tf32" if config.tf32 else "--no-tf32"]
    words += ["--weight-streaming"] if config.weight_streaming else []
    words += ["--strip-weights"] if config.strip_weights else []
    words += [f"--compute-capability {','.join(config.compute_capabilities)}"] if config.compute_capabilities else []
    return " ".join(words)


def _build(config: TrtBuildConfig, source: Artifact, out_dir: Path, store: Store, level_reason: str) -> dict[str, Any]:
    which = product(config.product)
    request = worker_request(config, source, out_dir, current_device() if which.builds_on_gpu else 0)
    request_path = out_dir / "request.json"
    request_path.write_text(json.dumps(request, indent=2))
    log_path = out_dir / LOG_NAME
    started = time.perf_counter()
    how_long = "minutes for SD 1.5" if which.builds_on_gpu else "ahead of time on the CPU; seconds for tiny models"
    with step(f"Building the {which.label} plan ({how_long})"), log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "sdtrt.stages.trt_build_worker", str(request_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    result_path = out_dir / "result.json"
    if proc.returncode != 0:
        kept = store.keep_log(log_path, f"{STAGE}-{time.strftime('%Y%m%d-%H%M%S')}.log")
        if proc.returncode == REFUSED_EXIT and result_path.is_file():  # the worker's own one-line reason
            raise BuildError(f"{json.loads(result_path.read_text())['refused']} (build log: {kept})")
        how = (
            f"was killed by {signal.Signals(-proc.returncode).name} (often: out of host or GPU memory)"
            if proc.returncode < 0
            else f"exited with code {proc.returncode}"
        )
        said = f": {last_error(kept)}" if kept.is_file() and last_error(kept) else ""
        raise BuildError(f"the {which.label} build {how}{said}; its log is {kept}")
    result = json.loads(result_path.read_text())
    result_path.unlink()
    plan = Path(request["plan"])
    check_plan(plan, which)
    spec = tensorrt_spec(source)
    quantized = {"quantization": {"format": request["quantization"], "quantize_layers": result["quantize_layers"]}}
    targets = {"compute_capabilities": list(config.compute_capabilities) or DEFAULT_COMPUTE_CAPABILITIES}
    return {
        "primary": plan.name,
        "io": spec.to_json(),
        "profile": config.effective_profiles()[0].to_json(),
        "profiles": [p.to_json() for p in config.effective_profiles()],
        "target": which.name,
        "timings": {"build_s": round(time.perf_counter() - started, 3)},
        "details": {
            which.name: result["version"],
            "network_layers": result["layers"],
            # What was built, by the type each layer computes in; the worker refused a network with none in the
            # graph's precision.
            "layer_types": result["layer_types"],
            "layers": layer_summary(result["layer_types"]),
            "plan_bytes": plan.stat().st_size,
            "parameters": parameter_count(Path(request["onnx"])),
            "optimization_level": {"level": config.optimization_level, "why": level_reason},
            "worker_request": request,
        }
        | (quantized if request["quantization"] else {})
        | (targets if which.compute_capabilities else {}),
        "reproduce": reproduce_command(config, source.path),
    } | ({"weights": refill_record(source)} if config.strip_weights else {})


def current_device() -> int:
    import torch

    return torch.cuda.current_device()


def check_plan(plan: Path, which: Product) -> None:
    """BuildError unless the plan is there and starts as the product's plans do (TensorRT-RTX 1.7's: ``vtrt``)."""
    with plan.open("rb") as file:
        head = file.read(len(which.plan_magic or b""))
    if which.plan_magic and head != which.plan_magic:
        raise BuildError(f"{plan} does not start as a {which.label} plan does ({which.plan_magic!r}, found {head!r})")
