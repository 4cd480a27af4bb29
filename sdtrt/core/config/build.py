"""The build stages' configurations: ONNX Runtime, TensorRT (and its optimization level), the TorchScript wrap."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..trt_products import ProductName, product, settings_problem
from .keys import in_key_unless, not_in_key
from .shapes import Range, ShapeProfile

OrtOptimization = Literal["basic", "extended"]


@dataclass(frozen=True)
class OrtBuildConfig:
    """The ONNX Runtime target: graph optimizations applied once and saved, plus the shape profile.

    "all" is not offered: its layout-specific rewrites tie a saved graph to one CPU's kernels.
    """

    profile: ShapeProfile = ShapeProfile()
    optimization: OrtOptimization = "extended"
    provider: Literal["cpu", "cuda"] = "cpu"

    def __post_init__(self) -> None:
        if self.optimization not in ("basic", "extended"):
            raise ConfigError(f"ONNX Runtime optimization '{self.optimization}' is not basic or extended")


# Builder optimization level when none is asked for: TensorRT's own default (NvInfer.h,
# IBuilderConfig::setBuilderOptimizationLevel: "The default optimization level is 3"), and 4 for 8-bit Q/DQ graphs
# except Flux's, as NVIDIA's demo/Diffusion chooses (dd_argparse.py process_pipeline_args: `if args.int8 or args.fp8
# and not is_flux: 4`, "optimization level set to 3 for all Flux pipelines to reduce GPU memory usage") and ModelOpt's
# diffusers example builds (`trtexec --builderOptimizationLevel=4 --stronglyTyped`). The demo quantizes no SD3; sdtrt
# treats a quantized SD3 transformer (2-8 B parameters) as the demo treats every non-Flux one: level 4, whose extra
# tactics need more build memory than level 3 (--optimization-level 3 when that is short). The manifest says why.
DEFAULT_OPTIMIZATION_LEVEL = 3
FLUX_ARCHITECTURE = "FluxTransformer2DModel"  # spec.FluxTransformerSpec.architecture (config sits below spec)


def default_optimization_level(
    parameters: int, quantization: str | None = None, architecture: str = ""
) -> tuple[int, str]:
    """The builder optimization level for a network of this many parameters (its ONNX weights), quantized to
    ``quantization`` ("int8", "fp8") or not, of this ``architecture`` (a GraphSpec's), and why."""
    size = f"{parameters / 1e9:.1f} B parameters" if parameters >= 1e9 else f"{parameters / 1e6:.0f} M parameters"
    if quantization and architecture == FLUX_ARCHITECTURE:
        why = f"{quantization.upper()} Q/DQ Flux: level 3, as NVIDIA's demo keeps for Flux, to bound GPU memory"
        return 3, f"{size}, {why}"
    if quantization:
        why = f"{quantization.upper()} Q/DQ: level 4, as NVIDIA's demo and ModelOpt's diffusers example build them"
        return 4, f"{size}, {why}"
    return DEFAULT_OPTIMIZATION_LEVEL, f"{size}: TensorRT's default level 3"


@dataclass(frozen=True)
class TrtBuildConfig:
    """The TensorRT target. The network is strongly typed: precision (fp32, fp16, bf16) comes from the ONNX graph."""

    # One optimization profile per entry; a request runs on the first profile that covers it.
    profiles: tuple[ShapeProfile, ...] = (ShapeProfile(),)
    # Build for each profile's optimum shape only (min = opt = max): faster engines, CUDA graphs.
    static_shapes: bool = False
    workspace_gb: float | None = None  # None: TensorRT's default (the GPU's memory)
    # TensorRT builder optimization level, 0..5; None: by the network's size (default_optimization_level), which
    # the build stage resolves before keying, so the key and manifest hold the level built with.
    optimization_level: int | None = None
    refittable: bool = False  # BuilderFlag.REFIT: LoRAs refit the weights in place (sdtrt.lora.refit)
    # BuilderFlag.TF32, on in TensorRT by default: fp32 convolutions and matmuls in TF32 (10-bit mantissa).
    # None: off for fp32 graphs ("fp32" means fp32), on for fp16 and bf16 ones (their few fp32 layers, as before);
    # the build stage resolves it (tf32_for). compile sets it on for members it made fp32 for range, not asked
    # (compile.upcast_tf32). Keyed only when off, so the keys of earlier builds stay.
    tf32: bool | None = in_key_unless(None, True)
    # BuilderFlag.WEIGHT_STREAMING: the engine can run with only part of its weights on the GPU, streaming the
    # rest from host memory (a 12 B transformer on a 24 GB GPU); the budget is set when the engine is loaded.
    weight_streaming: bool = in_key_unless(False, False)
    # BuilderFlag.STRIP_PLAN: the plan holds no refittable weights (kilobytes to megabytes instead of the graph's
    # gigabytes); every load refills them from the ONNX graph it was built from, which must stay in the store.
    # Off by default, at any size: such a plan cannot be copied without its graph, nor wrapped as TorchScript.
    strip_weights: bool = in_key_unless(False, False)
    # A timing cache makes rebuilds faster; it does not change what the engine computes.
    timing_cache: str | None = not_in_key(None)
    # Which TensorRT builds the plan (core/trt_products.py), and for TensorRT-RTX the compute capabilities it runs on
    # ("8.6", …; empty: TensorRT-RTX's default set). Keyed only when not the datacenter default, so earlier keys stay.
    product: ProductName = in_key_unless("tensorrt", "tensorrt")
    compute_capabilities: tuple[str, ...] = in_key_unless((), ())

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ConfigError("a TensorRT build needs at least one shape profile")
        which = product(self.product)
        if problem := settings_problem(which, self.compute_capabilities, self.timing_cache, self.optimization_level):
            raise ConfigError(problem)
        if self.optimization_level is not None and not 0 <= self.optimization_level <= 5:
            raise ConfigError(f"builder optimization level {self.optimization_level} is outside 0..5")
        if self.workspace_gb is not None and self.workspace_gb <= 0:
            raise ConfigError(f"workspace {self.workspace_gb} GB must be positive")

    def tf32_for(self, precision: str) -> bool:
        """Whether TF32 is on for a graph of this precision ("fp32", "fp16", "bf16")."""
        return self.tf32 if self.tf32 is not None else precision != "fp32"

    def effective_profiles(self) -> tuple[ShapeProfile, ...]:
        if not self.static_shapes:
            return self.profiles
        return tuple(
            dataclasses.replace(
                p,
                batch=Range(p.batch.opt, p.batch.opt, p.batch.opt),
                height=Range(p.height.opt, p.height.opt, p.height.opt),
                width=Range(p.width.opt, p.width.opt, p.width.opt),
                tokens=Range(p.tokens.opt, p.tokens.opt, p.tokens.opt) if p.tokens else None,
            )
            for p in self.profiles
        )


@dataclass(frozen=True)
class WrapConfig:
    """TorchScript wrap of a TensorRT engine (torch-tensorrt); nothing here changes the engine."""

    format: Literal["torchscript"] = "torchscript"
