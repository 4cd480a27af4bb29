"""Frozen stage configurations.

Every field changes the stage's output unless it is declared with ``not_in_key()``; ``cache_key``
returns exactly the fields that do, so two configs that produce the same artifact share one key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from .errors import ConfigError
from .trt_products import ProductName, product, settings_problem

Precision = Literal["fp16", "bf16", "fp32"]
PRECISIONS: tuple[Precision, ...] = ("fp16", "bf16", "fp32")
Exporter = Literal["auto", "dynamo", "torchscript"]
IONaming = Literal["named", "indexed"]
Weights = Literal["auto", "load", "stream"]
SimplifyMethod = Literal["auto", "onnxsim", "fold", "stream"]
OrtOptimization = Literal["basic", "extended"]
# tensorrt-rtx: NVIDIA TensorRT for RTX, built ahead of time without a GPU (sdtrt/core/trt_products.py).
ConcreteTarget = Literal["onnxruntime", "tensorrt", "tensorrt-rtx"]
Target = Literal["auto", "onnxruntime", "tensorrt", "tensorrt-rtx"]
# The networks a pipeline calls, each exported and built as its own graph.
# A model's denoiser is a UNet (SD 1.x/2.x, SDXL) or a transformer (SD3, Flux); text_encoder_3 is SD3's T5.
Component = Literal[
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder",
]  # fmt: skip
COMPONENTS: tuple[Component, ...] = (
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder",
)  # fmt: skip
TEXT_ENCODERS: tuple[Component, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")

DEFAULT_PROMPT = "a photograph of an astronaut riding a horse"

# ONNX Runtime 1.31's CPU provider has no bfloat16 kernel for Conv, Gemm or even Add: none of the tiny UNet,
# VAE or CLIP bf16 graphs loads there (measured; session creation fails with NOT_IMPLEMENTED). bf16 is for
# TensorRT, whose strongly typed networks take it as they take fp16.
BF16_ON_ONNXRUNTIME = (
    "ONNX Runtime on a CPU cannot run bf16 graphs (it has no bfloat16 Conv, Gemm or Add kernels): bf16 is for "
    "--target tensorrt; use --precision fp16 or fp32 for onnxruntime"
)


def target_precision_problem(target: str, precision: str) -> str | None:
    """Why graphs of this precision cannot be built or run for this (resolved) target, or None."""
    return BF16_ON_ONNXRUNTIME if target == "onnxruntime" and precision == "bf16" else None


def not_in_key(default: Any) -> Any:
    """A config field that does not change the artifact (checks, verbosity, tolerances)."""
    return field(default=default, metadata={"in_key": False})


def in_key_unless(default: Any, value: Any) -> Any:
    """A config field that enters the key only when it is not ``value`` (what every earlier build did), so
    adding the field changes no existing key."""
    return field(default=default, metadata={"key_unless": value})


def cache_key(config: Any) -> dict[str, Any]:
    """The fields of a config dataclass that change its stage's output, as plain JSON data."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.metadata.get("in_key", True):
            continue
        if "key_unless" in f.metadata and getattr(config, f.name) == f.metadata["key_unless"]:
            continue
        out[f.name] = _plain(getattr(config, f.name))
    return out


def as_dict(config: Any) -> dict[str, Any]:
    """Every field of a config, for the manifest."""
    return {k: _plain(v) for k, v in dataclasses.asdict(config).items()}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return cache_key(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def grid_problem(name: str, value: int, multiple: int, within: Range | None = None) -> str | None:
    """Why an image side cannot be generated, or None: the one size rule every command applies. ``within``: the
    engines' range for this side (its ends are on the grid), so the size suggested is one they take."""
    if value > 0 and value % multiple == 0:
        return None
    nearest = max(multiple, round(value / multiple) * multiple)
    if within is not None:
        nearest = min(max(nearest, within.min), within.max)
    return (
        f"{name} {value} is not a positive multiple of {multiple} pixels, which this model's denoiser (its "
        f"UNet or transformer) and VAE need; use e.g. {nearest}"
    )


# The most images per prompt a profile may take: four times NVIDIA's demo/Diffusion (max_batch_size 16). A
# TensorRT engine reserves activation memory for its largest shapes and validation runs the largest batch, so a
# maximum beyond any GPU's or host's memory (1:1:1000000) would only fail later, at load or at validation.
MAX_BATCH = 64
# The most T5 tokens (max_sequence_length) SD3's and FLUX.1's pipelines take: their check_inputs refuse more.
MAX_T5_TOKENS = 512
# An example per kind of range in Range.parse's message: images per prompt, pixels, T5 tokens.
RANGE_EXAMPLES = {"batch": "1:2:4", "height": "256:512:768", "width": "256:512:768", "tokens": "32:256:512"}


class Range(NamedTuple):
    """A dimension's minimum, optimum (what the engine is tuned for) and maximum."""

    min: int
    opt: int
    max: int

    @classmethod
    def parse(cls, text: str, what: str) -> Range:
        """Parse ``N`` (static) or ``MIN:OPT:MAX``."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) == 1:
            values *= 3
        if len(values) != 3:
            raise ConfigError(f"{what} '{text}' is not N or MIN:OPT:MAX (e.g. {RANGE_EXAMPLES[what]})")
        return cls(*values)

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"


@dataclass(frozen=True)
class ShapeProfile:
    """Shapes an engine must accept, in user terms: images per prompt, pixel height/width and, for models with
    T5 (SD3, Flux), its token count (``max_sequence_length``).

    With classifier-free guidance (``guidance=True``) the UNet sees twice the batch.
    """

    batch: Range = Range(1, 1, 4)
    height: Range = Range(256, 512, 768)
    width: Range = Range(256, 512, 768)
    guidance: bool = True
    # None: no T5 in the model; keyed only when set, so the keys of UNet builds stay.
    tokens: Range | None = in_key_unless(None, None)

    @classmethod
    def around(cls, size_px: int, multiple: int) -> ShapeProfile:
        """The default profile for a model whose native resolution is ``size_px``."""
        low = max(multiple, (size_px // 2) // multiple * multiple)
        high = size_px * 3 // 2 // multiple * multiple
        return cls(Range(1, 1, 4), Range(low, size_px, high), Range(low, size_px, high))

    def to_json(self) -> dict[str, Any]:
        tokens = {"tokens": list(self.tokens)} if self.tokens else {}
        return {
            "batch": list(self.batch),
            "height": list(self.height),
            "width": list(self.width),
            "guidance": self.guidance,
        } | tokens

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapeProfile:
        tokens = Range(*data["tokens"]) if data.get("tokens") else None
        return cls(Range(*data["batch"]), Range(*data["height"]), Range(*data["width"]), data["guidance"], tokens)

    def unet_batch(self) -> Range:
        """The UNet's batch: doubled by guidance, except at the minimum (guidance off, or LCM/Turbo, runs 1×).

        A static batch (min = max) stays one shape: doubled throughout.
        """
        factor = 2 if self.guidance else 1
        low = self.batch.min * factor if self.batch.min == self.batch.max else self.batch.min
        return Range(low, self.batch.opt * factor, self.batch.max * factor)

    def tokens_problem(self, tokens: int) -> str | None:
        """Why a T5 token count (``max_sequence_length``) is outside the profile, or None."""
        if self.tokens is None or self.tokens.min <= tokens <= self.tokens.max:
            return None
        return (
            f"{tokens} T5 tokens are outside the engine's profile ({self.tokens.min}..{self.tokens.max}); use a "
            "max_sequence_length inside it or rebuild the engines with a --tokens range covering it"
        )

    def size_problem(self, height: int, width: int) -> str | None:
        """Why an image of this size is outside the profile, or None."""
        for name, value, rng in (("height", height, self.height), ("width", width, self.width)):
            if not rng.min <= value <= rng.max:
                return (
                    f"{name} {value} is outside the engine's profile ({rng.min}..{rng.max} px); use a size inside "
                    f"it or rebuild the engine with `sdtrt compile --{name} MIN:OPT:MAX` covering it"
                )
        return None

    def check(self, pixel_multiple: int) -> None:
        """Raise ConfigError unless every range is ordered, positive and on the model's grid."""
        ranges = (("batch", self.batch), ("height", self.height), ("width", self.width), ("tokens", self.tokens))
        for name, rng in ranges:
            if rng is not None and not 0 < rng.min <= rng.opt <= rng.max:
                raise ConfigError(f"{name} range {rng} must satisfy 0 < min <= opt <= max")
        if self.batch.max > MAX_BATCH:
            raise ConfigError(
                f"batch range {self.batch}: at most {MAX_BATCH} images per prompt (an engine reserves memory for its "
                "largest batch); generate larger sets in several calls"
            )
        if self.tokens is not None and self.tokens.max > MAX_T5_TOKENS:
            raise ConfigError(
                f"tokens range {self.tokens}: SD3 and FLUX.1 pipelines take at most {MAX_T5_TOKENS} T5 tokens "
                f"(max_sequence_length); use a maximum of {MAX_T5_TOKENS} or less"
            )
        for name, rng in (("height", self.height), ("width", self.width)):
            for value in rng:
                if problem := grid_problem(name, value, pixel_multiple):
                    raise ConfigError(problem)


@dataclass(frozen=True)
class ExportConfig:
    """torch → ONNX. The UNet's batch, height and width are always dynamic axes."""

    precision: Precision = "fp16"
    opset: int = 18
    # Both exporters were verified against PyTorch fp32 on ONNX Runtime. "auto" takes the
    # TorchScript-based one (the tiny UNet in ~1 s instead of ~40 s, SD 1.5 in ~30 s instead of ~60 s)
    # except for fp16 text encoders, where it writes LayerNorms with fp32 weights on fp16 inputs, a
    # graph ONNX Runtime refuses (transformers keeps CLIP's LayerNorms fp32); torch.export's does not.
    exporter: Exporter = "auto"
    # "indexed" names IO input_0.. / output_0, which `torchtrtc --embed-engine` expects.
    io_naming: IONaming = "named"
    component: Component = "unet"
    # How weights reach the graph: "load" the network whole, or "stream" them from the safetensors files into a
    # weight-free trace (torch.export's exporter; the same graph, tested); "auto" streams big folders (export.py).
    weights: Weights = not_in_key("auto")

    @property
    def chosen_exporter(self) -> Literal["dynamo", "torchscript"]:
        if self.exporter != "auto":
            return self.exporter
        # bf16: torch.export's, the one measured on bf16 UNet, VAE and CLIP graphs.
        if self.precision == "bf16" or (self.component in TEXT_ENCODERS and self.precision == "fp16"):
            return "dynamo"
        return "torchscript"

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ConfigError(f"component '{self.component}' is not one of {', '.join(COMPONENTS)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision '{self.precision}' is not one of {', '.join(PRECISIONS)}")
        if self.exporter not in ("auto", "dynamo", "torchscript"):
            raise ConfigError(f"exporter '{self.exporter}' is not auto, dynamo or torchscript")
        if self.exporter == "torchscript" and self.component in TEXT_ENCODERS and self.precision == "fp16":
            raise ConfigError(
                "the TorchScript-based exporter writes an invalid fp16 text encoder graph (fp32 LayerNorm weights "
                "on fp16 inputs); use --exporter dynamo (or auto)"
            )
        if self.io_naming not in ("named", "indexed"):
            raise ConfigError(f"io naming '{self.io_naming}' is not named or indexed")
        if self.weights not in ("auto", "load", "stream"):
            raise ConfigError(f"weights '{self.weights}' is not auto, load or stream")
        if self.weights == "stream" and self.exporter == "torchscript":
            raise ConfigError("streamed weights need torch.export's exporter; use --exporter dynamo (or auto)")
        if not 14 <= self.opset <= 23:
            raise ConfigError(f"opset {self.opset} is outside 14..23, the range sdtrt exports")


@dataclass(frozen=True)
class SimplifyConfig:
    """Graph simplification: onnxsim, constant folding + cleanup when onnxsim cannot cope, or ``stream``: a cleanup
    that never loads the weights (big graphs; ``auto`` picks it by the weights' size and the memory budget)."""

    method: SimplifyMethod = "auto"
    # Compare the simplified graph with its input on ONNX Runtime before accepting it.
    check: bool = not_in_key(True)
    check_min_cosine: float = not_in_key(0.9999)
    # Bytes of memory the stage may plan with; None: this machine's physical memory.
    memory_budget: int | None = not_in_key(None)

    def __post_init__(self) -> None:
        if self.method not in ("auto", "onnxsim", "fold", "stream"):
            raise ConfigError(f"simplify method '{self.method}' is not auto, onnxsim, fold or stream")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"memory budget {self.memory_budget} is not a positive number of bytes")

    def budget(self) -> int:
        """The memory budget in bytes: as set, else physical memory (os.sysconf)."""
        return self.memory_budget or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


QuantPrecision = Literal["int8", "fp8"]
QUANT_PRECISIONS: tuple[QuantPrecision, ...] = ("int8", "fp8")
QuantAlgorithm = Literal["max", "smoothquant"]
# NVIDIA's quantization levels (TensorRT demo/Diffusion --quantization-level, ModelOpt's diffusers example):
# what each quantizes beyond the layers always kept in high precision.
QUANT_LEVELS: dict[float, str] = {
    1.0: "convolutions only",
    2.0: "convolutions and feed-forward Linear layers",
    2.5: "convolutions, feed-forward and Q/K/V projections",
    3.0: "convolutions and every Linear layer",
    4.0: "level 3 plus attention (FP8 only, heads whose size is a multiple of 16)",
}
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "a photograph of an astronaut riding a horse",
    "a watercolor painting of a lighthouse at dusk",
    "a close-up portrait of an old fisherman, studio lighting",
    "a bowl of ramen on a wooden table, top view",
    "a futuristic city skyline at night with neon signs",
    "a red fox in a snowy forest, wildlife photography",
    "an isometric illustration of a tiny cozy library",
    "a mountain lake at sunrise, mist over the water",
)


def _levels() -> str:
    return "NVIDIA's levels (" + "; ".join(f"{level:g}: {what}" for level, what in QUANT_LEVELS.items()) + ")"


def parse_level(text: str) -> float:
    """A quantization level as given on the command line (``2.5``); ConfigError naming the levels when it is none."""
    try:
        level = float(text)
    except ValueError:
        raise ConfigError(f"quantization level '{text}' is not one of {_levels()}") from None
    return level


@dataclass(frozen=True)
class QuantizeConfig:
    """The denoiser quantized with NVIDIA ModelOpt to INT8 or FP8 Q/DQ graphs, calibrated on the pipeline's own
    denoising inputs: ``calibration_prompts`` × ``calibration_steps`` (seeded). The calibration fields enter the
    key as one hash of the calibration set (the stage adds it), not field by field.

    ``keep_high_precision``: module names (``down_blocks.0.attentions.0.proj_in``) left unquantized on top of
    the layers NVIDIA always keeps (conv_in/conv_out, time embeddings, shortcut convs, proj_out, ...).
    """

    precision: QuantPrecision = "int8"
    level: float = 2.5
    # INT8 calibration: "max" (ModelOpt's diffusers int8 preset) or "smoothquant" (its INT8_SMOOTHQUANT_CFG).
    algorithm: QuantAlgorithm = "max"
    keep_high_precision: tuple[str, ...] = ()
    calibration_prompts: tuple[str, ...] = not_in_key(CALIBRATION_PROMPTS[:4])
    calibration_steps: int = not_in_key(8)
    calibration_seed: int = not_in_key(0)

    def __post_init__(self) -> None:
        # One spelling per set of layers, so the same layers give the same key.
        object.__setattr__(self, "keep_high_precision", tuple(sorted(set(self.keep_high_precision))))
        object.__setattr__(self, "level", float(self.level))
        if self.precision not in QUANT_PRECISIONS:
            raise ConfigError(f"quantization precision '{self.precision}' is not int8 or fp8")
        if self.level not in QUANT_LEVELS:
            raise ConfigError(f"quantization level {self.level:g} is not one of {_levels()}")
        if self.level == 4.0 and self.precision != "fp8":
            raise ConfigError(
                "level 4 quantizes attention, which only FP8 does (INT8 attention runs slower than fp16 in TensorRT); "
                "use --level 3 for INT8, or --precision fp8"
            )
        if self.algorithm not in ("max", "smoothquant"):
            raise ConfigError(f"calibration algorithm '{self.algorithm}' is not max or smoothquant")
        if self.algorithm == "smoothquant" and self.precision != "int8":
            raise ConfigError("SmoothQuant is an INT8 calibration; FP8 calibrates with max")
        if not self.calibration_prompts or any(not p.strip() for p in self.calibration_prompts):
            raise ConfigError("the calibration set needs at least one prompt, and no empty ones")
        if self.calibration_steps < 1:
            raise ConfigError(f"calibration steps {self.calibration_steps} must be at least 1")

    def calibration_set(self) -> dict[str, Any]:
        """What defines the calibration inputs; its hash is part of the stage's key."""
        prompts, steps, seed = list(self.calibration_prompts), self.calibration_steps, self.calibration_seed
        return {"prompts": prompts, "steps": steps, "seed": seed}


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


# Sizes: decimal units are powers of 1000 (MB = 10^6 bytes), binary ones powers of 1024 (MiB = 2^20), as IEC 80000-13
# has them; both spellings parse, case aside.
DECIMAL_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
BINARY_UNITS = {"TiB": 1 << 40, "GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}
_BYTE_UNITS = {"": 1, "B": 1} | {unit.upper(): size for unit, size in (DECIMAL_UNITS | BINARY_UNITS).items()}


def parse_size(text: str) -> int:
    """Bytes from a size such as ``8GiB``, ``512MB`` or a number of bytes; ValueError when it is none."""
    value = text.strip().upper().replace(" ", "")
    number = value.rstrip("KMGTIB")
    try:
        size = float(number) * _BYTE_UNITS[value[len(number) :]]
    except (ValueError, KeyError, OverflowError):
        raise ValueError(f"'{text}' is not a size") from None
    if not 0 <= size < float("inf"):
        raise ValueError(f"'{text}' is not a size")
    return int(size)


def format_size(size: int) -> str:
    """A size in the units it was most likely given in: decimal (``1.0 MB``, ``8.00 GB``) when it is a whole number
    of hundredths of its decimal unit, as a size a person wrote in MB or GB is; else binary (``8.00 GiB``, and measured
    sizes). Two decimals from GB/GiB up, one below."""
    decimal = _unit_for(size, DECIMAL_UNITS)
    unit, scale = decimal if size * 100 % decimal[1] == 0 else _unit_for(size, BINARY_UNITS)
    return f"{size / scale:.{2 if scale >= 10**9 else 1}f} {'kB' if unit == 'KB' else unit}"


def _unit_for(size: int, units: dict[str, int]) -> tuple[str, int]:
    """The largest of ``units`` (largest first) that ``size`` reaches, else the smallest."""
    return next(((unit, scale) for unit, scale in units.items() if size >= scale), list(units.items())[-1])


@dataclass(frozen=True)
class WeightBudget:
    """How much of a weight-streaming engine's streamable weights stay on the GPU: ``auto`` (TensorRT's choice
    from free memory), a percentage of the streamable weights, or a size (``8GiB``, ``512MB``, bytes). It applies to
    each streaming engine of a set on its own: a size is kept per engine, never split across the set."""

    text: str
    percent: float | None = None
    size: int | None = None

    @classmethod
    def parse(cls, text: str) -> WeightBudget:
        value = text.strip().upper().replace(" ", "")
        try:
            if value == "AUTO":
                return cls(text)
            if value.endswith("%"):
                percent = float(value[:-1])
                if 0 <= percent <= 100:
                    return cls(text, percent=percent)
            else:
                return cls(text, size=parse_size(value))
        except ValueError:
            pass
        raise ConfigError(
            f"weight streaming budget '{text}' is not auto, a percentage 0%..100% of the streamable weights, "
            "or a size such as 8GiB, 512MB or a number of bytes"
        )


@dataclass(frozen=True)
class WrapConfig:
    """TorchScript wrap of a TensorRT engine (torch-tensorrt); nothing here changes the engine."""

    format: Literal["torchscript"] = "torchscript"


@dataclass(frozen=True)
class ValidationConfig:
    """What `validate` compares and how strictly; tolerances left None follow the engine's precision."""

    prompt: str = DEFAULT_PROMPT
    steps: int = 10
    guidance: float | None = None  # None: the model's own (7.5; FLUX.1-dev 3.5; schnell none)
    seed: int = 0
    scheduler: str | None = None
    images: bool = True
    height: int | None = None  # image comparison size; None: the engine profile's optimum
    width: int | None = None
    min_cosine: float | None = None
    max_abs: float | None = None
    min_psnr_db: float | None = None
    # GPU memory for the weights of engines built with weight streaming: where weights live, not what they compute.
    weight_budget: WeightBudget | None = not_in_key(None)
    # Host memory a comparison on the CPU may add; None: what is available when it runs. A case projected over it
    # is skipped and reported (ONNX Runtime's attention holds batch × heads × tokens² scores).
    memory_budget: int | None = not_in_key(None)


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
    guidance: float | None = None  # None: the model's own (7.5; FLUX.1-dev 3.5; schnell none)
    seed: int = 0
    precision: Precision = "fp16"  # engines' default; PyTorch runs fp32 on the CPU and fp16 on a GPU
    # (file, scale) LoRAs put into each backend before its runs: how long that and a swap take is reported.
    loras: tuple[tuple[str, float], ...] = ()

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
