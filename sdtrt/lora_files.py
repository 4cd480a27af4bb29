"""LoRA files: reading them into per-network low-rank pairs, the ``FILE[:SCALE]`` option, and making random ones.

A file (diffusers/PEFT or kohya/A1111 safetensors, or the folder ``save_lora_weights`` wrote) is read with
diffusers' own loader (``StableDiffusionPipeline.lora_state_dict``, which converts kohya names), split by
network and renamed to PEFT's ``<module>.lora_A/lora_B`` as diffusers' loaders rename it. Applying the pairs
to engines and PyTorch networks is sdtrt.lora's job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import LoraError, RequestError, one_line

if TYPE_CHECKING:
    import torch

    from .models import ModelSource

LoraSpec = tuple["str | os.PathLike[str]", float]
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save_lora_weights gives
# The networks LoRA files change, by the state-dict prefix diffusers gives each (and the pipeline attribute).
LORA_COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
# What random_lora puts adapters on: the attention and feed-forward projections LoRA trainers target.
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
RANDOM_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "text_encoder": CLIP_TARGETS,
    "text_encoder_2": CLIP_TARGETS,
}


def check_scale(scale: float, path: str | os.PathLike[str]) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise LoraError(f"LoRA scale {scale!r} for {path} is a {type(scale).__name__}, not a number (e.g. 0.8)")
    if math.isnan(scale) or math.isinf(scale) or scale < 0:
        raise LoraError(f"LoRA scale {scale} for {path} must be a finite number ≥ 0 (e.g. 0.8)")
    return float(scale)


def checked_loras(loras: Sequence[LoraSpec]) -> list[tuple[Path, float]]:
    """(file, scale) pairs with their scales checked; LoraError for anything else, such as a bare path."""
    if isinstance(loras, str | os.PathLike):
        loras = [loras]  # type: ignore[list-item]  # reported below, item by item
    checked = []
    for item in loras:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise LoraError(f'LoRAs are (file, scale) pairs, e.g. [("style.safetensors", 0.8)]; got {item!r}')
        checked.append((Path(item[0]), check_scale(item[1], item[0])))
    return checked


def parse_lora_option(value: str) -> tuple[str, float]:
    """``FILE[:SCALE]`` → (file, scale); the scale defaults to 1.0 and is checked."""
    path, sep, tail = value.rpartition(":")
    if not sep or not path or Path(value).exists():  # no scale, or a colon that is part of the file's name
        return value, 1.0
    try:
        scale = float(tail)
    except ValueError:
        message = f"--lora {value}: '{tail}' is not a scale; write FILE[:SCALE], e.g. style.safetensors:0.8"
        raise LoraError(message) from None
    return path, check_scale(scale, path)


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

    def add_to(self, weight: torch.Tensor, scale: float, transposed: bool) -> None:
        """weight += scale·ΔW, ΔW = (alpha/rank)·B·A, in place in one matrix product (no ΔW is made).

        ``weight`` is fp32 and 2-D: [out, in·kernel], or [in, out] where the graph holds it transposed.
        """
        up, down = self.up.flatten(1).float(), self.down.flatten(1).float()
        if transposed:
            weight.addmm_(down.T, up.T, alpha=scale * self.scale)
        else:
            weight.addmm_(up, down, alpha=scale * self.scale)


@dataclass(frozen=True)
class LoraFile:
    path: Path
    format: str  # "diffusers (PEFT)", "diffusers (legacy)", "kohya"
    parts: dict[str, dict[str, LoraModule]]  # network (LORA_COMPONENTS) → module name → its low-rank pair


def _format(keys: list[str]) -> str | None:
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers (PEFT)"
    if any(".lora.down." in k or "lora_linear_layer" in k or "_lora.down." in k for k in keys):
        return "diffusers (legacy)"
    return None


def read_lora(path: str | os.PathLike[str]) -> LoraFile:
    """A LoRA file's UNet and text encoder parts, in PEFT form; LoraError naming the first thing sdtrt cannot use."""
    import safetensors

    from .models import quiet_loading

    path = Path(path)
    if path.is_dir():  # a folder save_lora_weights wrote: its file, as diffusers' load_lora_weights finds it
        if not (path / DIFFUSERS_LORA_FILE).is_file():
            raise LoraError(f"{path} is a folder without {DIFFUSERS_LORA_FILE}; pass the LoRA's .safetensors file")
        path = path / DIFFUSERS_LORA_FILE
    if not path.is_file():
        raise LoraError(f"LoRA file {path} does not exist")
    try:
        with safetensors.safe_open(str(path), "pt") as handle:
            keys = list(handle.keys())
    except Exception as exc:  # SafetensorError for truncated or foreign files, OSError, …
        raise LoraError(f"{path} is not a readable safetensors file ({one_line(exc)})") from exc
    kind = _format(keys)
    if kind is None:
        raise LoraError(f"{path} is not a LoRA file sdtrt knows (first key '{keys[0] if keys else '(none)'}')")
    with quiet_loading():
        from diffusers import StableDiffusionPipeline
    try:
        state_dict, alphas, metadata = StableDiffusionPipeline.lora_state_dict(
            str(path), use_safetensors=True, local_files_only=True, return_lora_metadata=True
        )
    except Exception as exc:  # diffusers raises ValueError for names it cannot convert
        raise LoraError(f"diffusers cannot read the LoRA {path}: {one_line(exc)}") from exc
    prefixes = tuple(f"{c}." for c in LORA_COMPONENTS)
    if other := next((k for k in state_dict if not k.startswith(prefixes)), None):
        raise LoraError(
            f"{path}: '{other}' is not a weight of the {', '.join(LORA_COMPONENTS)} networks sdtrt applies LoRAs to"
        )
    parts = {}
    for component in LORA_COMPONENTS:
        prefix = f"{component}."
        weights = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if not weights:
            continue
        # kohya's alphas come keyed by diffusers' intermediate weight names (`….to_q_lora.down.weight.alpha`):
        # the renaming that gives the weights their modules gives the alphas theirs.
        alpha_keys = {k[len(prefix) : -len(".alpha")]: v for k, v in (alphas or {}).items() if k.startswith(prefix)}
        try:
            module_alphas = {k.split(".lora_A.")[0]: float(v) for k, v in peft_names(component, alpha_keys).items()}
            renamed = peft_names(component, weights)
        except ValueError as exc:  # diffusers' converters: "Could not automatically infer state dict type"
            raise LoraError(f"diffusers cannot convert the {component} part of {path}: {one_line(exc)}") from exc
        config = {k[len(prefix) :]: v for k, v in (metadata or {}).items() if k.startswith(prefix)}
        parts[component] = _modules(path, renamed, module_alphas, config)
    return LoraFile(path, kind, parts)


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

    if component == "unet":
        return convert_unet_state_dict_to_peft(state_dict)
    renamed = convert_state_dict_to_peft(convert_state_dict_to_diffusers(state_dict)) if state_dict else {}
    return {k.removeprefix("text_model."): v for k, v in renamed.items()}


def _modules(
    path: Path, weights: dict[str, torch.Tensor], alphas: dict[str, float], config: dict[str, Any]
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
                f"{path}: '{key}' is not a LoRA up/down weight (DoRA, biases and LyCORIS are not supported)"
            )
        if part == "B.weight":
            continue
        up = weights.get(f"{module}.lora_B.weight")
        if up is None:
            raise LoraError(f"{path}: '{module}' has a down (lora_A) weight but no up (lora_B) weight")
        down = weights[key]
        alpha = alphas.get(module)
        if alpha is None:
            pattern = next((p for p in patterns if module == p or module.endswith("." + p)), None)
            alpha = patterns[pattern] if pattern else config.get("lora_alpha", down.shape[0])
        modules[module] = LoraModule(down, up, float(alpha), bool(config.get("use_rslora")))
    return modules


def describe(lora: LoraFile) -> dict[str, Any]:
    """What `sdtrt lora inspect` prints: format, networks, modules, ranks, alphas, scales."""
    pairs = [pair for modules in lora.parts.values() for pair in modules.values()]
    return {
        "file": str(lora.path),
        "format": lora.format,
        "networks": ", ".join(f"{c} ({len(m)} modules)" for c, m in lora.parts.items()),
        "ranks": sorted({m.rank for m in pairs}),
        "alphas": sorted({m.alpha for m in pairs}),
        "scales": sorted({round(m.scale, 6) for m in pairs}),
    }


def lora_out(out: str | os.PathLike[str]) -> Path:
    """Where a new LoRA file goes; RequestError unless it is a .safetensors file."""
    if Path(out).suffix != ".safetensors":
        raise RequestError(f"{out}: a LoRA file is .safetensors, e.g. style.safetensors")
    return Path(out)


def random_lora(
    model: ModelSource,
    out: str | os.PathLike[str],
    *,
    rank: int = 8,
    alpha: int = 8,
    seed: int = 0,
    text_encoders: bool = False,
) -> Path:
    """A LoRA with random weights, to try LoRAs without training one: PEFT's ``LoraConfig`` on the model's
    UNet (and, with ``text_encoders``, each text encoder it has), saved by the model's own pipeline class
    with ``save_lora_weights`` as diffusers' training scripts save theirs. Written whole or not at all."""
    import tempfile

    import diffusers
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from .models import load_folder, quiet_loading

    out = lora_out(out)
    if not model.has("unet"):
        raise LoraError(f"'{model.name}' has no UNet in a pipeline folder; random LoRAs are made for UNet pipelines")
    with quiet_loading():
        pipeline = getattr(diffusers, model.pipeline_class(), None)
    if pipeline is None or not hasattr(pipeline, "save_lora_weights"):
        raise LoraError(f"diffusers' {model.pipeline_class() or 'pipeline'} of '{model.name}' cannot save LoRAs")
    networks = ["unet", *(c for c in LORA_COMPONENTS[1:] if text_encoders and model.has(c))]
    layers: dict[str, Any] = {}
    with torch.random.fork_rng():  # seeded without changing the caller's random state
        torch.manual_seed(seed)
        for network in networks:
            module = load_folder(model, network)
            config = LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=RANDOM_TARGETS[network], init_lora_weights=False
            )
            module.add_adapter(config)
            layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
            layers[f"{network}_lora_adapter_metadata"] = config.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        pipeline.save_lora_weights(tmp, weight_name=out.name, **layers)
        os.replace(Path(tmp) / out.name, out)
    return out
