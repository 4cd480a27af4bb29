"""Which of a denoiser's layers are quantized, and NVIDIA ModelOpt's config that says so.

The layers NVIDIA keeps in high precision are never quantized (per denoiser kind: ``DenoiserQuantization``), and the
level picks the Linear layers (NVIDIA's ``quantize_lvl`` in TensorRT demo/Diffusion and ModelOpt's
examples/diffusers/quantization/utils.py, one rule for UNets and transformers); the config is ModelOpt's diffusers
preset with the kept layers switched off. Also ModelOpt itself: importing it, and keeping its prints quiet.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.config import QUANT_LEVELS, Component, QuantizeConfig
from ..core.errors import ConfigError, MissingDependencyError, one_line
from ..sources.models import ModelSource
from ..spec import denoiser_component

if TYPE_CHECKING:
    import torch

# The layers NVIDIA keeps in high precision in a UNet: TensorRT demo/Diffusion's filter_func (proj_out included for
# UNets) and ModelOpt's filter_func_default.
ALWAYS_KEPT = re.compile(
    r".*(time_emb_proj|time_embedding|conv_in|conv_out|conv_shortcut|add_embedding|pos_embed|time_text_embed"
    r"|context_embedder|x_embedder|norm_out|proj_out).*"
)
ATTENTION_QUANTIZERS = (
    "q_bmm_quantizer",
    "k_bmm_quantizer",
    "v_bmm_quantizer",
    "softmax_quantizer",
    "bmm2_output_quantizer",
)
# In a transformer (SD3, Flux): ModelOpt's examples/diffusers/quantization/utils.py filter_func_flux_dev
# (time_text_embed, context_embedder, x_embedder, norm_out and the final proj_out, anchored: a Flux single block's
# proj_out is quantized) and filter_func_default, which its models.py gives SD3-Medium / SD3.5 (pos_embed), with
# the final proj_out kept for SD3 too, as its earlier quantize_lvl did for every backbone (``name != "proj_out"``).
TRANSFORMER_KEPT = re.compile(r"proj_out$|.*(pos_embed|time_text_embed|context_embedder|x_embedder|norm_out).*")


def attention_quantized(config: QuantizeConfig) -> bool:
    """Level 4 quantizes attention (FP8 only: QuantizeConfig refuses INT8 there)."""
    return config.level >= 4


def head_sizes(unet_config: dict[str, Any]) -> list[int]:
    """The attention head size of each UNet block (diffusers: channels // heads, the heads being
    ``num_attention_heads`` or, as SD 1.x/2.x configs spell it, ``attention_head_dim``)."""
    channels = unet_config["block_out_channels"]
    heads = unet_config.get("num_attention_heads") or unet_config["attention_head_dim"]
    heads = heads if isinstance(heads, list | tuple) else [heads] * len(channels)
    return [c // h for c, h in zip(channels, heads, strict=True)]


def transformer_head_sizes(config: dict[str, Any]) -> list[int]:
    """An SD3 / Flux transformer's one attention head size (diffusers names it ``attention_head_dim``)."""
    return [config["attention_head_dim"]]


@dataclass(frozen=True)
class DenoiserQuantization:
    """How NVIDIA quantizes one kind of denoiser: the modules it always keeps in high precision, and the levels
    that quantize anything in it, with why each other level is refused."""

    kept: re.Pattern[str]
    kept_why: str
    refused: dict[float, str]  # level → why
    head_sizes: Callable[[dict[str, Any]], list[int]]


UNET_QUANTIZATION = DenoiserQuantization(
    ALWAYS_KEPT, "kept by NVIDIA (embeddings, first/last and shortcut convolutions, proj_out)", {}, head_sizes
)
QUANTIZATION: dict[Component, DenoiserQuantization] = {
    "unet": UNET_QUANTIZATION,
    "transformer": DenoiserQuantization(
        TRANSFORMER_KEPT,
        "kept by NVIDIA (patch and text embedders, timestep embeddings, the output norm and projection)",
        {
            # SD3's one convolution is its patch embedding (pos_embed.proj, kept), and Flux has none.
            1.0: "a transformer's only convolution (SD3's patch embedding) stays in high precision: nothing would "
            "be quantized",
            # Level 4's fp16 export with FP8 attention is measured on UNets only (tiny-sd2); the transformers'
            # attention processors have not been through it.
            4.0: "sdtrt offers FP8 attention for UNets only so far",
        },
        transformer_head_sizes,
    ),
}


def denoiser_quantization(model: ModelSource) -> DenoiserQuantization:
    """How the model's denoiser is quantized: its kind's."""
    return QUANTIZATION[denoiser_component(model)]


@dataclass(frozen=True)
class LayerPlan:
    """Which Linear/Conv (and LayerNorm) modules are quantized, and why each other one is kept in high precision."""

    quantized: tuple[str, ...]
    kept: dict[str, str]  # module name → reason

    def disabled_entries(self) -> list[dict[str, Any]]:
        """ModelOpt quant_cfg entries switching the kept modules' quantizers off."""
        return [{"quantizer_name": f"{name}.*", "enable": False} for name in self.kept]


def plan_layers(
    network: torch.nn.Module, config: QuantizeConfig, kind: DenoiserQuantization = UNET_QUANTIZATION
) -> LayerPlan:
    """The layer selection for ``config``: the layers NVIDIA keeps in this ``kind`` of denoiser, the level's Linear
    layers, the user's list.

    ConfigError when ``keep_high_precision`` names a module the network does not have.
    """
    import torch

    names = {name for name, _ in network.named_modules()}
    if unknown := [name for name in config.keep_high_precision if name not in names]:
        raise ConfigError(
            f"keep_high_precision names {', '.join(unknown[:3])}, which the denoiser does not have; "
            "use module names such as down_blocks.0.attentions.0.proj_in"
        )
    quantized, kept = [], {}
    for name, module in network.named_modules():
        if not isinstance(module, torch.nn.Linear | torch.nn.Conv2d | torch.nn.LayerNorm):
            continue
        why = _kept_because(name, module, config, kind)
        if why is None:
            quantized.append(name)
        else:
            kept[name] = why
    return LayerPlan(tuple(quantized), kept)


def _kept_because(name: str, module: torch.nn.Module, config: QuantizeConfig, kind: DenoiserQuantization) -> str | None:
    import torch

    if any(name == kept or name.startswith(kept + ".") for kept in config.keep_high_precision):
        return "asked (keep_high_precision)"
    if kind.kept.match(name):
        return kind.kept_why
    level = config.level
    if isinstance(module, torch.nn.LayerNorm):
        # ModelOpt quantizes LayerNorms for FP8 attention fusion (nn/modules/quant_layernorm.py): level 4's.
        return None if level >= 4 else f"level {level:g}: LayerNorms are quantized with attention (level 4)"
    if isinstance(module, torch.nn.Linear):
        selected = (
            (level >= 2 and "ff.net" in name)
            or (level >= 2.5 and re.search(r"\.to_[qkv]$", name) is not None)
            or level >= 3
        )
        return None if selected else f"level {level:g}: {QUANT_LEVELS[level]}"
    return None  # convolutions: every level


def modelopt() -> Any:
    """``modelopt.torch.quantization``, or MissingDependencyError saying how to install it."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise MissingDependencyError(
            f"quantization needs NVIDIA ModelOpt ({one_line(exc)}); install it with pip install 'sdtrt[quant]' "
            "(never nvidia-modelopt[onnx]: it replaces onnxruntime with onnxruntime-gpu)"
        ) from exc
    return mtq


def modelopt_config(config: QuantizeConfig, plan: LayerPlan) -> dict[str, Any]:
    """ModelOpt's diffusers preset for the precision, with the plan's kept layers switched off."""
    mtq = modelopt()
    from modelopt.torch.quantization.config import _load_quantize_config_dict

    if config.algorithm == "smoothquant":
        base = mtq.INT8_SMOOTHQUANT_CFG
    else:  # examples/diffusers/quantization/config.py loads the same presets
        base = _load_quantize_config_dict(f"configs/ptq/presets/diffusers/{config.precision}")
    quant = copy.deepcopy(base)
    # fp32 model: ModelOpt's default "Half" asserts on fp32 inputs (the example's set_quant_config_attr sets it).
    for entry in quant["quant_cfg"]:
        cfg = entry.get("cfg")
        if isinstance(cfg, dict) and "num_bits" in cfg:
            cfg["trt_high_precision_dtype"] = "Float"
    if attention_quantized(config):
        # FP8 attention: the BMM inputs and the softmax output, as ModelOpt's diffusers plugin quantizes them
        # (plugins/diffusion/diffusers.py _quantized_sdpa; export_onnx.py export_fp8_mha), the BMM2 output not.
        fp8 = {"num_bits": (4, 3), "axis": None, "trt_high_precision_dtype": "Float"}
        quant["quant_cfg"] += [{"quantizer_name": f"*{q}", "cfg": dict(fp8)} for q in ATTENTION_QUANTIZERS[:4]]
        quant["quant_cfg"] += [{"quantizer_name": f"*{ATTENTION_QUANTIZERS[4]}", "enable": False}]
    else:  # attention stays in high precision below level 4, as TensorRT demo/Diffusion's fp8_mha_disable leaves it
        quant["quant_cfg"] += [{"quantizer_name": f"*{q}", "enable": False} for q in ATTENTION_QUANTIZERS]
    quant["quant_cfg"] += plan.disabled_entries()
    # Kept modules that own quantizers themselves (an attention's BMM quantizers, which the guard may return).
    quant["quant_cfg"] += [{"quantizer_name": f"{name}.*", "enable": False} for name in config.keep_high_precision]
    return quant


@contextlib.contextmanager
def _quiet() -> Any:
    """ModelOpt prints per-quantizer notices (``mtq.quantize``'s "Inserted N quantizers": a bare print in
    modelopt/torch/quantization/conversion.py) and warns about untested versions: progress lines say what runs, so
    its output is dropped (SDTRT_DEBUG=1 keeps it, on stderr)."""
    debug = os.environ.get("SDTRT_DEBUG", "") not in ("", "0")
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr if debug else io.StringIO()):
        if not debug:
            warnings.simplefilter("ignore")
        yield
