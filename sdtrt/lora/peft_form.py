"""A network's part of a LoRA file in PEFT's form: its keys renamed to PEFT's ``<module>.lora_A/B.weight`` as diffusers'
loaders rename them, and each module's low-rank pair with its alpha (the file's, its ``alpha_pattern``'s, or its
``lora_alpha``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import LoraError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoraModule:
    down: torch.Tensor  # lora_A: [rank, in, *kernel]
    up: torch.Tensor  # lora_B: [out, rank, 1, 1 | ·]
    alpha: float
    rslora: bool = False

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it changes, in PyTorch's layout."""
        return (int(self.up.shape[0]), *(int(d) for d in self.down.shape[1:]))

    def padded(self, in_features: int) -> LoraModule:
        """The pair for a Linear with more input features, its down weight zero-padded (as FLUX.1's loader pads it)."""
        import torch

        down = torch.nn.functional.pad(self.down, (0, in_features - int(self.down.shape[1])))
        return LoraModule(down, self.up, self.alpha, self.rslora)

    def add_to(self, weight: torch.Tensor, scale: float, transposed: bool) -> None:
        """weight += scale·ΔW, ΔW = (alpha/rank)·B·A, in place in one matrix product (no ΔW is made).

        ``weight`` is fp32 and 2-D: [out, in·kernel], or [in, out] where the graph holds it transposed.
        """
        up, down = self.up.flatten(1).float(), self.down.flatten(1).float()
        if transposed:
            weight.addmm_(down.T, up.T, alpha=scale * self.scale)
        else:
            weight.addmm_(up, down, alpha=scale * self.scale)


def peft_names(component: str, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Keys renamed to PEFT's ``<module>.lora_A/B.weight`` the way diffusers' loaders rename them.

    The UNet as ``load_lora_into_unet`` does; text encoders as ``_load_lora_into_text_encoder`` does
    (diffusers loaders/lora_base.py), with CLIP's ``text_model.`` prefix dropped: recent transformers
    flatten CLIPTextModel, and weight maps name text encoder weights without it (weight_map.lora_parameters).
    """
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    if component in ("unet", "transformer"):  # a transformer as diffusers' load_lora_adapter renames it
        return convert_unet_state_dict_to_peft(state_dict)
    # PEFT's names need no renaming, and diffusers' converters cannot tell them without an attention layer (a LoRA on
    # fc1/fc2 only: "Could not automatically infer state dict type")
    peft = all(".lora_A." in k or ".lora_B." in k for k in state_dict)
    renamed = state_dict if peft else convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict))
    return {k.removeprefix("text_model."): v for k, v in renamed.items()}


def lora_modules(
    path: Path, component: str, weights: dict[str, torch.Tensor], alphas: dict[str, float], config: dict[str, Any]
) -> dict[str, LoraModule]:
    """One network's modules; ``config`` is its adapter metadata (lora_alpha, alpha_pattern, use_rslora, …)."""
    if config.get("use_dora"):
        raise LoraError(f"{path} is a DoRA adapter; sdtrt applies plain LoRAs only")
    patterns = config.get("alpha_pattern") or {}
    modules = {}
    for key in weights:
        module, sep, part = key.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise LoraError(
                f"{path}: '{key}' is not a LoRA up/down weight (DoRA, LoRA biases, the norm weights BFL's FLUX.1 "
                "Control LoRAs replace, and LyCORIS are not supported)"
            )
        if part == "B.weight":
            continue
        up = weights.get(f"{module}.lora_B.weight")
        if up is None:
            raise LoraError(f"{path}: '{module}' has a down (lora_A) weight but no up (lora_B) weight")
        down = weights[key]
        alpha = alphas.get(module)
        if alpha is None:
            alpha = pattern_alpha(patterns, module, component, config.get("lora_alpha", down.shape[0]))
        modules[module] = LoraModule(down, up, float(alpha), bool(config.get("use_rslora")))
    return modules


def pattern_alpha(patterns: dict[str, float], module: str, component: str, default: float) -> float:
    """A module's alpha as PEFT finds it in ``alpha_pattern``: the first pattern that matches the end of its name as a
    regular expression (peft.utils.other.get_pattern_key). Text encoder modules are named here without CLIP's
    ``text_model.``, which a PyTorch CLIP's names may have, so patterns are tried on both."""
    from peft.utils.other import get_pattern_key

    names = [module, f"text_model.{module}"] if component.startswith("text_encoder") else [module]
    found = next((key for name in names if (key := get_pattern_key(list(patterns), name)) in patterns), None)
    return patterns[found] if found is not None else default
