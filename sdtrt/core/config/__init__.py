"""Frozen stage configurations, grouped by the stage that owns them.

Every field changes the stage's output unless it is declared with ``not_in_key()``; ``cache_key`` returns exactly the
fields that do, so two configs that produce the same artifact share one key (keys.py). The shapes an engine accepts
are in shapes.py, the networks and precisions every stage names in components.py and precision.py; each stage's
config is in the module named for it (export.py, simplify.py, quantize.py, build.py, validation.py, bench.py), and
sizes.py reads the byte sizes users give. The names are re-exported here, so ``from sdtrt.core.config import X`` works.
"""

from __future__ import annotations

from .bench import BENCH_BACKENDS, ENGINE_BACKENDS, BenchConfig
from .build import (
    DEFAULT_OPTIMIZATION_LEVEL,
    FLUX_ARCHITECTURE,
    OrtBuildConfig,
    OrtOptimization,
    TrtBuildConfig,
    WrapConfig,
    default_optimization_level,
)
from .components import (
    BUILDABLE,
    COMPONENTS,
    FREEU_MEMBER,
    IMAGE_ENCODER,
    STEP_CACHES,
    TEXT_ENCODERS,
    TRANSFORMER_PARTS,
    UNET_PARTS,
    VISION_ENCODER,
    Component,
)
from .export import ExportConfig, Exporter, IONaming, Weights
from .keys import as_dict, cache_key, in_key_unless, not_in_key
from .precision import BF16_ON_ONNXRUNTIME, PRECISIONS, ConcreteTarget, Precision, Target, target_precision_problem
from .quantize import (
    CALIBRATION_PROMPTS,
    QUANT_LEVELS,
    QUANT_PRECISIONS,
    QuantAlgorithm,
    QuantizeConfig,
    QuantPrecision,
    parse_level,
)
from .shapes import (
    MAX_BATCH,
    MAX_T5_TOKENS,
    RANGE_EXAMPLES,
    T5_TOKEN_CAP,
    Range,
    ShapeProfile,
    TokenCap,
    grid_problem,
    pixel_size,
)
from .simplify import SimplifyConfig, SimplifyMethod
from .sizes import BINARY_UNITS, DECIMAL_UNITS, WeightBudget, format_size, parse_size
from .step_cache import CACHE_SETTINGS, CacheCalibrationConfig
from .validation import DEFAULT_PROMPT, ValidationConfig

__all__ = [
    "BENCH_BACKENDS",
    "BF16_ON_ONNXRUNTIME",
    "BINARY_UNITS",
    "BUILDABLE",
    "CACHE_SETTINGS",
    "CALIBRATION_PROMPTS",
    "COMPONENTS",
    "DECIMAL_UNITS",
    "DEFAULT_OPTIMIZATION_LEVEL",
    "DEFAULT_PROMPT",
    "ENGINE_BACKENDS",
    "FLUX_ARCHITECTURE",
    "FREEU_MEMBER",
    "IMAGE_ENCODER",
    "MAX_BATCH",
    "MAX_T5_TOKENS",
    "PRECISIONS",
    "QUANT_LEVELS",
    "QUANT_PRECISIONS",
    "RANGE_EXAMPLES",
    "STEP_CACHES",
    "T5_TOKEN_CAP",
    "TEXT_ENCODERS",
    "TRANSFORMER_PARTS",
    "UNET_PARTS",
    "VISION_ENCODER",
    "BenchConfig",
    "CacheCalibrationConfig",
    "Component",
    "ConcreteTarget",
    "ExportConfig",
    "Exporter",
    "IONaming",
    "OrtBuildConfig",
    "OrtOptimization",
    "Precision",
    "QuantAlgorithm",
    "QuantPrecision",
    "QuantizeConfig",
    "Range",
    "ShapeProfile",
    "SimplifyConfig",
    "SimplifyMethod",
    "Target",
    "TokenCap",
    "TrtBuildConfig",
    "ValidationConfig",
    "WeightBudget",
    "Weights",
    "WrapConfig",
    "as_dict",
    "cache_key",
    "default_optimization_level",
    "format_size",
    "grid_problem",
    "in_key_unless",
    "not_in_key",
    "parse_level",
    "parse_size",
    "pixel_size",
    "target_precision_problem",
]
