"""LoRA files: reading them into per-network low-rank pairs, the ``FILE[:SCALE]`` option, and making random ones.

A file (diffusers/PEFT, kohya/A1111 or ai-toolkit safetensors, or the folder ``save_lora_weights`` wrote) is read
with the loader of the model's family in diffusers (``lora_state_dict`` of StableDiffusionPipeline for the UNet
families, StableDiffusion3Pipeline for SD3, FluxPipeline for FLUX.1 with Fill / Control / Kontext,
Flux2KleinPipeline for FLUX.2 [klein] and [dev] (Flux2Pipeline's is the same Flux2LoraLoaderMixin method): each
converts the kohya and ai-toolkit names of its family), split by network and renamed to PEFT's
``<module>.lora_A/lora_B`` as diffusers' loaders rename it.
Applying the pairs to engines and PyTorch networks is sdtrt.lora.refit's job.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import LoraError, RequestError, one_line
from .kinds import LORA_FAMILIES, LoraFamily, kind_for, lora_kind
from .peft_form import LoraModule, lora_modules, peft_names

if TYPE_CHECKING:
    from ..sources.models import ModelSource

# One scale for every network the file changes, or one per network (component → scale, 1.0 where none is given, as
# diffusers' set_adapters takes {"unet": 0.5, "text_encoder": 1.0}).
Scale = float | Mapping[str, float]
LoraSpec = tuple["str | os.PathLike[str]", Scale]
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save_lora_weights gives
# The networks LoRA files change, by the state-dict prefix diffusers gives each (and the pipeline attribute).
LORA_COMPONENTS = ("unet", "transformer", "text_encoder", "text_encoder_2")


# What random_lora puts adapters on: the attention and feed-forward projections LoRA trainers target (the Linear and
# Conv2d modules whose names end so). The transformer's cover SD3's joint blocks (SD3.5's attn2 too), FLUX.1's and
# FLUX.2's double- and single-stream blocks, and Flux's x_embedder (the input Fill and Control widen), Z-Image's
# SwiGLU (w1-w3) and Qwen-Image's image and text MLPs.
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
RANDOM_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "transformer": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out",
                    "linear_in", "linear_out", "to_qkv_mlp_proj", "to_out", "x_embedder", "w1", "w2", "w3",
                    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"],
    "text_encoder": CLIP_TARGETS,
    "text_encoder_2": CLIP_TARGETS,
}  # fmt: skip


def check_scale(scale: float, path: str | os.PathLike[str]) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise LoraError(f"LoRA scale {scale!r} for {path} is a {type(scale).__name__}, not a number (e.g. 0.8)")
    if math.isnan(scale) or math.isinf(scale):  # negative ones subtract the LoRA, as diffusers takes them
        raise LoraError(f"LoRA scale {scale} for {path} must be a finite number (e.g. 0.8)")
    return float(scale)


def checked_loras(loras: Sequence[LoraSpec]) -> list[tuple[Path, Scale]]:
    """(file, scale) pairs with their scales checked; LoraError for anything else, such as a bare path."""
    if isinstance(loras, str | os.PathLike):
        loras = [loras]  # type: ignore[list-item]  # reported below, item by item
    checked: list[tuple[Path, Scale]] = []
    for item in loras:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise LoraError(f'LoRAs are (file, scale) pairs, e.g. [("style.safetensors", 0.8)]; got {item!r}')
        checked.append((Path(item[0]), check_scales(item[1], item[0])))
    return checked


def check_scales(scale: Scale, path: str | os.PathLike[str]) -> Scale:
    """One scale, or per-network scales whose networks take LoRAs, each checked."""
    if not isinstance(scale, Mapping):
        return check_scale(scale, path)
    if unknown := [c for c in scale if c not in LORA_COMPONENTS]:
        networks = ", ".join(LORA_COMPONENTS)
        raise LoraError(f"LoRA scales for {path} name {unknown[0]!r}, which takes no LoRAs; name {networks}")
    return {str(c): check_scale(v, path) for c, v in scale.items()}


def network_scale(scale: Scale, component: str) -> float:
    """A LoRA's scale on one network: its only scale, or that network's (1.0 where per-network scales name none)."""
    return float(scale.get(component, 1.0)) if isinstance(scale, Mapping) else float(scale)


def for_network(loras: Sequence[tuple[Any, Scale]], component: str) -> list[tuple[Any, float]]:
    """Each LoRA (a file, or a file read) with its scale on one network."""
    return [(lora, network_scale(scale, component)) for lora, scale in loras]


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
class LoraFile:
    path: Path
    format: str  # "diffusers (PEFT)", "diffusers (legacy)", "kohya", "kohya (BFL names)", "ai-toolkit"
    family: str  # the LoraFamily label it was read as: "UNet (SD 1.x/2.x, SDXL)", "SD3", "FLUX.1", "FLUX.2"
    parts: dict[str, dict[str, LoraModule]]  # network (LORA_COMPONENTS) → module name → its low-rank pair
    pads_inputs: bool = False  # its family's loader zero-pads down weights narrower than their Linear (LoraFamily)

    def pads(self, component: str) -> bool:
        """Whether a narrower down weight is zero-padded on this network: the transformer's, as diffusers pads
        (CLIP's go to PEFT, which refuses the size)."""
        return self.pads_inputs and component == "transformer"


def _format(keys: list[str]) -> str | None:
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if bfl := [k for k in keys if k.startswith("diffusion_model.")]:  # BFL's own module names
        return "kohya (BFL names)" if any(".lora_down." in k for k in bfl) else "ai-toolkit"  # ComfyUI's export
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers (PEFT)"
    if any(".lora.down." in k or "lora_linear_layer" in k or "_lora.down." in k for k in keys):
        return "diffusers (legacy)"
    return None


def read_lora(path: str | os.PathLike[str], family: str | None = None) -> LoraFile:
    """A LoRA file's parts, network by network, in PEFT form, read with the loader of ``family`` (the model's,
    ModelSource.family(); None: the kind the file's names say). LoraError naming the first thing sdtrt cannot
    use, a file for another kind of model included."""
    path, keys, kind = _file_and_keys(path)
    lora_family = LORA_FAMILIES[kind_for(path, keys, family)]
    state_dict, alphas, metadata = _lora_state_dict(path, lora_family)
    networks = lora_family.networks
    if other := next((k for k in state_dict if not k.startswith(tuple(f"{c}." for c in networks))), None):
        # CLIP's weights are under text_model. (T5's under encoder.): CLIP layers for a network this family has
        # as T5 (Flux's text_encoder_2) or lacks are from another family's LoRA (SD3's, SDXL's).
        why = (
            "a CLIP encoder's weight: a LoRA for another model (SD3, SDXL)?"
            if ".text_model." in other
            else "T5 and LLM text encoders take none, as in diffusers"
        )
        raise LoraError(
            f"{path}: '{other}' is not a weight of the {', '.join(networks)} networks sdtrt applies "
            f"{lora_family.label} LoRAs to ({why})"
        )
    parts = {}
    for component in networks:
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
        parts[component] = lora_modules(path, component, renamed, module_alphas, config)
    return LoraFile(path, kind, lora_family.label, parts, lora_family.pads_inputs)


def check_family(path: str | os.PathLike[str], family: str) -> None:
    """LoraFamilyError where a LoRA file's names say it is for another kind of model than ``family``'s, read from its
    header alone (no tensors, no diffusers): the CLI refuses it before anything loads."""
    path, keys, _ = _file_and_keys(path)
    kind_for(path, keys, family)


def _file_and_keys(path: str | os.PathLike[str]) -> tuple[Path, list[str], str]:
    """The LoRA's file (a save_lora_weights folder's, as diffusers' load_lora_weights finds it), its tensors' names
    and its format; LoraError for a file that is missing, unreadable or no LoRA."""
    import safetensors

    path = Path(path)
    if path.is_dir():
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
    if (kind := _format(keys)) is None:
        raise LoraError(f"{path} is not a LoRA file sdtrt knows (first key '{keys[0] if keys else '(none)'}')")
    return path, keys, kind


def _lora_state_dict(path: Path, lora_family: LoraFamily) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
    """(state dict, alphas or None, adapter metadata) as the family's diffusers loader reads the file."""
    import diffusers

    from ..sources.models import quiet_loading

    with quiet_loading():
        loader = getattr(diffusers, lora_family.loader)
    try:
        state_dict, *alphas, metadata = loader.lora_state_dict(
            str(path), use_safetensors=True, local_files_only=True, return_lora_metadata=True,
            **dict(lora_family.loader_kwargs),
        )  # fmt: skip
    except Exception as exc:  # diffusers raises ValueError (AssertionError in Flux's kohya converter) for names it
        raise LoraError(f"diffusers cannot read the LoRA {path}: {one_line(exc)}") from exc  # cannot convert
    return state_dict, (alphas[0] if alphas else None), metadata


def describe(lora: LoraFile) -> dict[str, Any]:
    """What `sdtrt lora inspect` prints: format, networks, modules, ranks, alphas, scales."""
    pairs = [pair for modules in lora.parts.values() for pair in modules.values()]
    return {
        "file": str(lora.path),
        "format": lora.format,
        "family": lora.family,
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
    UNet or transformer (and, with ``text_encoders``, each text encoder of it that takes LoRAs: CLIP, not T5),
    saved by the model's own pipeline class with ``save_lora_weights`` as diffusers' training scripts save
    theirs. Written whole or not at all."""
    import tempfile

    import diffusers
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from ..core.store import follow_umask
    from ..sources.models import load_folder, quiet_loading

    out = lora_out(out)
    denoiser = model.denoiser_folder  # unet or transformer: component and folder have the same name
    if not model.has(denoiser):
        raise LoraError(f"'{model.name}' has no {denoiser} in a pipeline folder; random LoRAs are made for pipelines")
    with quiet_loading():
        pipeline = getattr(diffusers, model.pipeline_class(), None)
    if pipeline is None or not hasattr(pipeline, "save_lora_weights"):
        raise LoraError(f"diffusers' {model.pipeline_class() or 'pipeline'} of '{model.name}' cannot save LoRAs")
    family = LORA_FAMILIES[lora_kind(model.family())]
    networks = [denoiser, *(c for c in family.networks[1:] if text_encoders and model.has(c))]
    layers: dict[str, Any] = {}
    with torch.random.fork_rng():  # seeded without changing the caller's random state
        torch.manual_seed(seed)
        for network in networks:
            module = load_folder(model, network)
            config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=_targets(module, RANDOM_TARGETS[network]),
                                init_lora_weights=False)  # fmt: skip
            module.add_adapter(config)
            layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
            layers[f"{network}_lora_adapter_metadata"] = config.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        pipeline.save_lora_weights(tmp, weight_name=out.name, **layers)
        follow_umask(Path(tmp))  # written 0600 (a temporary file), as the store's artifacts are not
        os.replace(Path(tmp) / out.name, out)
    return out


def _targets(network: Any, suffixes: list[str]) -> list[str]:
    """The network's Linear and Conv2d modules whose names end with one of ``suffixes``: PEFT's own matching would
    also take a module list of that name (SD3's and FLUX.1's ``attn.to_out``, FLUX.2's single-block Linear)."""
    import torch

    return [name for name, module in network.named_modules() if isinstance(module, torch.nn.Linear | torch.nn.Conv2d)
            and any(name == s or name.endswith(f".{s}") for s in suffixes)]  # fmt: skip
