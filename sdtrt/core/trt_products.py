"""The two TensorRT products sdtrt builds with, and every way they differ, named in one place.

``tensorrt`` is NVIDIA's datacenter TensorRT: it builds on the GPU the engine will run on, autotunes there (builder
optimization level, timing cache) and ties the engine to that GPU's compute capability. ``tensorrt-rtx`` is NVIDIA
TensorRT for RTX (module ``tensorrt_rtx``): the same Python API narrowed to strongly typed networks, building ahead of
time on a CPU for a list of compute capabilities, and compiling the rest just in time on the GPU that loads the plan.
Everything else (parse, profiles, strongly typed network, stripped and refittable plans, weight streaming, Q/DQ and
layer-precision checks, the build log) is one path: ``sdtrt.stages.trt_build_worker``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from .errors import ConfigError

if TYPE_CHECKING:
    import tensorrt_rtx as rtx  # the names only TensorRT-RTX has: tests/test_rtx.py checks them in the module

ProductName = Literal["tensorrt", "tensorrt-rtx"]


@dataclass(frozen=True)
class Product:
    name: ProductName  # the --target that builds with it
    module: str  # what the build worker imports
    label: str  # how messages name it
    distribution: str  # what pip installs
    # The build runs on the CUDA device it builds for (datacenter); else ahead of time, no GPU needed.
    builds_on_gpu: bool
    # IBuilderConfig.set_timing_cache: datacenter TensorRT reuses measured tactic timings. TensorRT-RTX: "ITimingCache
    # at build time: No impact on the serialized engine; requires a GPU during AOT ... Do not use" (TensorRT-RTX docs,
    # Timing Cache Migration; deprecated in TensorRT-RTX 1.2).
    timing_cache: bool
    # IBuilderConfig.builder_optimization_level: how many tactics the datacenter builder times. TensorRT-RTX binds the
    # attribute but does no autotuning ("As TRT-RTX does not use autotuning", pytorch/TensorRT#3817, where NVIDIA
    # removed the timing cache from Torch-TensorRT's RTX build), so sdtrt leaves it at TensorRT-RTX's own setting.
    optimization_level: bool
    # IBuilderConfig.num_compute_capabilities / set_compute_capability(trt.ComputeCapability.SMxx, i): TensorRT-RTX only
    # (NVIDIA/TensorRT-RTX samples/apiUsage/python/api_usage.py create_builder_config).
    compute_capabilities: bool
    # Plans begin with these bytes: measured for TensorRT-RTX 1.7 (every plan tests/test_rtx.py builds).
    plan_magic: bytes | None
    # Refittable (REFIT, REFIT_IDENTICAL) and weight-stripped (STRIP_PLAN) plans need a CUDA GPU at build time, even
    # ahead of time. Measured with tensorrt_rtx 1.7.1.116 on a machine without one: every such build of sdtrt's tiny
    # UNet, CLIP and VAE graphs fails in the compiler ("MyelinCheckException: graph_jit.cpp:278: CHECK(status ==
    # CUDA_SUCCESS) failed", build_serialized_network → None), with or without set_compute_capability, while the same
    # graphs build without those flags (and with WEIGHT_STREAMING).
    refit_needs_gpu: bool = False


TENSORRT = Product(
    "tensorrt", "tensorrt", "TensorRT", "tensorrt", builds_on_gpu=True, timing_cache=True, optimization_level=True,
    compute_capabilities=False, plan_magic=None,
)  # fmt: skip
TENSORRT_RTX = Product(
    "tensorrt-rtx", "tensorrt_rtx", "TensorRT-RTX", "tensorrt-rtx", builds_on_gpu=False, timing_cache=False,
    optimization_level=False, compute_capabilities=True, plan_magic=b"vtrt", refit_needs_gpu=True,
)  # fmt: skip
PRODUCTS: dict[str, Product] = {p.name: p for p in (TENSORRT, TENSORRT_RTX)}
RTX_INSTALL = "install it with `pip install 'sdtrt[rtx]'` (tensorrt-rtx from PyPI: no GPU needed to build)"

# --compute-capability → trt.ComputeCapability member (tensorrt_rtx 1.7: SM75, SM80, SM86, SM89, SM120, SM121; NONE
# and CURRENT are not targets an AOT build on another machine can name). tests/test_rtx.py checks this against the
# installed module.
COMPUTE_CAPABILITIES = {"7.5": "SM75", "8.0": "SM80", "8.6": "SM86", "8.9": "SM89", "12.0": "SM120", "12.1": "SM121"}
# Left unset, TensorRT-RTX builds for "all RTX compute capabilities, Ampere and later"; Turing (7.5) must be asked for
# (NVIDIA/TensorRT-RTX samples/apiUsage/python/api_usage.py).
DEFAULT_COMPUTE_CAPABILITIES = "TensorRT-RTX's default: 8.0 and later (Ampere, Ada, Blackwell)"
RTX_DEFAULT_CAPABILITIES = tuple(c for c in COMPUTE_CAPABILITIES if c != "7.5")  # the set that sentence names


def product(name: str) -> Product:
    try:
        return PRODUCTS[name]
    except KeyError:
        raise ConfigError(f"TensorRT product '{name}' is not one of {', '.join(PRODUCTS)}") from None


def load(which: Product) -> ModuleType:
    """The product's Python module (imported only when a build or a run needs it)."""
    return importlib.import_module(which.module)


def rtx_missing() -> str | None:
    """Why TensorRT-RTX cannot build here, or None. An import, not a lookup: a module that is present but cannot load
    its libraries is missing too."""
    try:
        load(TENSORRT_RTX)
    except ImportError as exc:
        return f"TensorRT-RTX (the tensorrt_rtx module) cannot be imported ({exc}); {RTX_INSTALL}"
    return None


def rtx_runtime_missing() -> str | None:
    """Why a TensorRT-RTX plan cannot run here, or None: it needs a CUDA GPU (an RTX-class one of a compute capability
    it was built for) and the tensorrt_rtx module."""
    import torch

    if not torch.cuda.is_available():
        return (
            "no CUDA GPU is visible to torch (TensorRT-RTX plans build anywhere but run on RTX-class GPUs of compute "
            "capability 8.0 or newer, 7.5 when built for it)"
        )
    return rtx_missing()


def rtx_turing_problem(graph_precision: str, compute_capabilities: tuple[str, ...]) -> str | None:
    """Why TensorRT-RTX cannot build a graph of ``graph_precision`` for these compute capabilities, or None: it
    compiles no fp32 matrix multiply for Turing. Building tiny's fp32 VAE decoder for 7.5 with TensorRT-RTX 1.7.1.116
    ends in "Cannot compile operation 'MatMul_1' for Turing (SM75): FP32 GEMM is not supported" (measured here), and
    every network sdtrt exports has MatMuls (attention, projections)."""
    if graph_precision != "fp32" or "7.5" not in compute_capabilities:
        return None
    return (
        "TensorRT-RTX compiles no fp32 matrix multiply (MatMul, Gemm) for Turing (compute capability 7.5: "
        '"FP32 GEMM is not supported"), and this graph is fp32; leave 7.5 out of --compute-capability (a Turing GPU '
        "runs the tensorrt target's engines), or build the graph in fp16"
    )


def rtx_gpu_problem(details: Mapping[str, Any]) -> str | None:
    """Why this machine's GPU cannot run the TensorRT-RTX plan a build-trt manifest's ``details`` describe, or None:
    the plan was built for a list of compute capabilities without this GPU's (or for TensorRT-RTX's default set,
    8.0 and later, and this GPU is older), or this GPU lacks the Tensor Cores of the plan's 8-bit format (FP8: 8.9).
    Call it where rtx_runtime_missing() is None. The plan's header check at load would refuse the first with advice
    to rebuild for this GPU, which the build refuses for an FP8 plan."""
    from .gpu import capability_version, gpu_environment, quantization_problem

    env = gpu_environment()
    here, gpu = env["compute_capability"], env["gpu"]
    built_for = details.get("compute_capabilities")
    explicit = built_for if isinstance(built_for, list) and built_for else None  # else TensorRT-RTX's default set
    if explicit and here not in explicit:
        return f"{gpu} has compute capability {here}, and the plan was built for {', '.join(explicit)}"
    if not explicit and capability_version(here) < (8, 0):
        return f"{gpu} has compute capability {here}, and the plan was built for {DEFAULT_COMPUTE_CAPABILITIES}"
    quantized = (details.get("quantization") or {}).get("format")
    return quantization_problem(quantized, here, gpu) if quantized else None


def parse_compute_capabilities(text: str | None) -> tuple[str, ...]:
    """``--compute-capability 8.6,8.9,12.0`` → ("8.6", "8.9", "12.0"), in the order given, once each; ConfigError naming
    the known ones for anything else."""
    if not text:
        return ()
    wanted = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [c for c in wanted if c not in COMPUTE_CAPABILITIES]
    if unknown or not wanted:
        raise ConfigError(
            f"compute capability '{','.join(unknown) or text}' is not one TensorRT-RTX builds for; choose from "
            f"{', '.join(COMPUTE_CAPABILITIES)} (comma-separated), or leave --compute-capability out for "
            f"{DEFAULT_COMPUTE_CAPABILITIES}"
        )
    return wanted


def gpu_only_problem(which: Product, refittable: bool, strip_weights: bool) -> str | None:
    """Why ``which`` cannot build a refittable or weight-stripped plan on this machine (no CUDA GPU), or None."""
    if not (which.refit_needs_gpu and (refittable or strip_weights)):
        return None
    import torch

    if torch.cuda.is_available():
        return None
    option = "--refittable" if refittable else "--strip-weights"
    return (
        f"{option}: {which.label} {load(which).__version__} builds refittable and weight-stripped plans only where a "
        "CUDA GPU is visible (without one its compiler stops: MyelinCheckException graph_jit.cpp:278, CUDA_SUCCESS), "
        f"and none is here; build without {option} (--weight-streaming builds), or on a machine with an NVIDIA GPU"
    )


def settings_problem(
    which: Product, compute_capabilities: tuple[str, ...], timing_cache: str | None, optimization_level: int | None
) -> str | None:
    """Why these build settings do not apply to ``which``, or None: each setting only one product has."""
    if compute_capabilities and not which.compute_capabilities:
        return (
            f"--compute-capability picks the GPUs a TensorRT-RTX plan runs on, and {which.label} builds for the GPU it "
            "runs on; use --target tensorrt-rtx, or leave --compute-capability out"
        )
    if unknown := [c for c in compute_capabilities if c not in COMPUTE_CAPABILITIES]:
        return f"compute capability {unknown[0]} is not one TensorRT-RTX builds for ({', '.join(COMPUTE_CAPABILITIES)})"
    if timing_cache and not which.timing_cache:
        return (
            f"--timing-cache needs a GPU at build time, and a {which.label} build is ahead of time on the CPU (its "
            "timing cache is deprecated and changes no plan; the runtime cache on the GPU replaces it); leave "
            "--timing-cache out"
        )
    if optimization_level is not None and not which.optimization_level:
        return (
            f"--optimization-level sets how many tactics datacenter TensorRT times on its GPU, and {which.label} does "
            "no autotuning at build time; leave --optimization-level out"
        )
    return None


def set_compute_capabilities(rtx: ModuleType, config: rtx.IBuilderConfig, wanted: list[str]) -> None:
    """The GPUs a TensorRT-RTX plan runs on: num_compute_capabilities first, then each by index
    (IBuilderConfig.set_compute_capability returns False for an index out of range or NONE: tensorrt_rtx 1.7's
    docstring; NVIDIA/TensorRT-RTX samples/apiUsage/python/api_usage.py). None given: TensorRT-RTX's default set."""
    if not wanted:
        return
    config.num_compute_capabilities = len(wanted)
    for index, capability in enumerate(wanted):
        if not config.set_compute_capability(getattr(rtx.ComputeCapability, COMPUTE_CAPABILITIES[capability]), index):
            raise RuntimeError(f"TensorRT-RTX refused compute capability {capability} at index {index}")
