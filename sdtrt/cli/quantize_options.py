"""How the denoiser is quantized: the options of `quantize` and `compile --precision int8|fp8`, declared once, and
their parsing into a QuantizeConfig, refused (exit 2) before anything loads."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, cast

import typer

from ..core.config import CALIBRATION_PROMPTS, QUANT_LEVELS, QuantAlgorithm, QuantizeConfig, QuantPrecision, parse_level
from ..core.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from ..sources.models import ModelSource

# Quantization (`quantize`, and `compile --precision int8|fp8`).
QuantPrecisionOpt = Annotated[QuantPrecision, typer.Option("--precision", help="int8, or fp8 (E4M3).")]
LEVEL_HELP = "NVIDIA's quantization level: " + "; ".join(f"{k:g}: {v}" for k, v in QUANT_LEVELS.items()) + "."
# A str parsed by config.parse_level: a bad level is one line naming the levels, not Typer's error box.
LEVEL_METAVAR = f"<{'|'.join(f'{k:g}' for k in QUANT_LEVELS)}>"
LevelOpt = Annotated[str, typer.Option(metavar=LEVEL_METAVAR, help=LEVEL_HELP)]
CalibrationPromptsOpt = Annotated[
    str | None,
    typer.Option(
        help=f"A text file of prompts (one a line), or N: the first N of sdtrt's {len(CALIBRATION_PROMPTS)} built-in "
        f"prompts (default {len(QuantizeConfig().calibration_prompts)})."
    ),
]
STEPS_HELP = "Denoising steps per calibration prompt; every step's denoiser inputs calibrate."
CalibrationStepsOpt = Annotated[int, typer.Option(help=STEPS_HELP)]
ALGORITHM_HELP = "INT8 calibration: max (ModelOpt's preset) or smoothquant."
AlgorithmOpt = Annotated[QuantAlgorithm, typer.Option(help=ALGORITHM_HELP)]
# compile's: unset unless given, so that one given without --precision int8|fp8 is refused, not ignored.
_DEFAULTS = QuantizeConfig()
CompileLevelOpt = Annotated[
    str | None,
    typer.Option("--level", metavar=LEVEL_METAVAR, help=f"{LEVEL_HELP} int8/fp8 only (default {_DEFAULTS.level:g})."),
]
CompileStepsOpt = Annotated[
    int | None,
    typer.Option("--calibration-steps", help=f"{STEPS_HELP} int8/fp8 only (default {_DEFAULTS.calibration_steps})."),
]
CompileAlgorithmOpt = Annotated[
    QuantAlgorithm | None,
    typer.Option("--algorithm", help=f"{ALGORITHM_HELP} int8 only (default {_DEFAULTS.algorithm})."),
]


def quantize_config(
    precision: str, level: str | None, algorithm: str | None, prompts: str | None, steps: int | None
) -> QuantizeConfig:
    """The options as a QuantizeConfig (QuantizeConfig's defaults for those None), or RequestError (exit 2) before
    anything loads."""
    try:
        config = QuantizeConfig(
            precision=cast(QuantPrecision, precision),
            level=_DEFAULTS.level if level is None else quant_level(level),
            algorithm=cast(QuantAlgorithm, algorithm or _DEFAULTS.algorithm),
            calibration_steps=_DEFAULTS.calibration_steps if steps is None else steps,
        )
        chosen = calibration_prompts(prompts)
        return dataclasses.replace(config, calibration_prompts=chosen) if chosen else config
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def quant_level(text: str) -> float:
    """--level, or RequestError (exit 2) naming NVIDIA's levels."""
    try:
        return parse_level(text)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc


def calibration_prompts(text: str | None) -> tuple[str, ...] | None:
    """--calibration-prompts: N (of the built-in prompts) or a file of prompts, one a line; None: the default."""
    from pathlib import Path

    if text is None:
        return None
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= len(CALIBRATION_PROMPTS):
            raise RequestError(
                f"--calibration-prompts {count}: sdtrt has {len(CALIBRATION_PROMPTS)} built-in prompts; "
                "give 1.." + f"{len(CALIBRATION_PROMPTS)}, or a file with more (one prompt a line)"
            )
        return CALIBRATION_PROMPTS[:count]
    path = Path(text)
    if not path.is_file():
        raise RequestError(f"--calibration-prompts '{text}' is neither a number nor a readable file of prompts")
    prompts = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if not prompts:
        raise RequestError(f"--calibration-prompts {path} holds no prompt (one prompt a line)")
    return prompts


def check_quantizable(config: QuantizeConfig, source: ModelSource) -> None:
    """The model's configs against the quantization config (level 4's head sizes, …): exit 2 before loading."""
    from ..stages.quantize import check_model

    try:
        check_model(config, source)
    except ConfigError as exc:
        raise RequestError(str(exc)) from exc
