"""The quantize stage's configuration: NVIDIA's quantization levels and the calibration set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError
from .keys import not_in_key

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
