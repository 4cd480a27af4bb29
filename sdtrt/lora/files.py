"""LoRA files: reading them into per-network low-rank pairs, the ``FILE[:SCALE]`` option, and making random ones.

A file (diffusers/PEFT or kohya/A1111 safetensors, or the folder ``save_lora_weights`` wrote) is read with
the loader of the model's family in diffusers (``lora_state_dict`` of StableDiffusionPipeline for the UNet
families, StableDiffusion3Pipeline for SD3, FluxPipeline for Flux: each converts the kohya names of its
family), split by network and renamed to PEFT's ``<module>.lora_A/lora_B`` as diffusers' loaders rename it.
Applying the pairs to engines and PyTorch networks is sdtrt.lora.refit's job.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import LoraError, RequestError, one_line
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


@dataclass(frozen=True)
class LoraFamily:
    """How one kind of model takes LoRAs: the diffusers pipeline whose ``lora_state_dict`` reads its files
    (and converts its kohya names), and the networks they change (that loader's ``_lora_loadable_modules``)."""

    label: str
    loader: str
    networks: tuple[str, ...]
    # lora_state_dict's keywords for (state dict, alphas, metadata): FluxPipeline's returns alphas only when
    # asked, StableDiffusion3Pipeline's has none (diffusers loaders/lora_pipeline.py).
    loader_kwargs: tuple[tuple[str, bool], ...] = ()


# By model family (ModelSource.family()). T5 (SD3's text_encoder_3, Flux's text_encoder_2) takes no LoRAs: diffusers
# loads none into it (its loaders list no T5), so a file with T5 weights is refused by name.
LORA_FAMILIES = {
    "unet": LoraFamily(
        "UNet (SD 1.x/2.x, SDXL)", "StableDiffusionPipeline", ("unet", "text_encoder", "text_encoder_2")
    ),
    "sd3": LoraFamily("SD3", "StableDiffusion3Pipeline", ("transformer", "text_encoder", "text_encoder_2")),
    "flux": LoraFamily("Flux", "FluxPipeline", ("transformer", "text_encoder"), (("return_alphas", True),)),
}
# Module names only one kind's LoRAs have (diffusers' and kohya's), as patterns searched in its keys: a file naming
# them is for that kind. SD3.5's joint blocks have a second attention (attn2) that Flux's have not, and UNet keys
# name theirs under unet. (SD3.0's LoRAs name nothing Flux's could not.)
FAMILY_MARKERS = {
    "flux": r"single_transformer_blocks|lora_unet_double_blocks_|lora_unet_single_blocks_|proj_mlp",
    "unet": r"down_blocks|up_blocks|mid_block",
    "sd3": r"^transformer\.transformer_blocks\.\d+\.attn2\.",
}
# What random_lora puts adapters on: the attention and feed-forward projections LoRA trainers target. The
# transformer's cover SD3's joint blocks (SD3.5's attn2 too) and Flux's double- and single-stream blocks.
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
RANDOM_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"],
    "transformer": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"],
    "text_encoder": CLIP_TARGETS,
    "text_encoder_2": CLIP_TARGETS,
}  # fmt: skip


def lora_kind(family: str) -> str:
    """The LORA_FAMILIES key of a model family: sd3, flux (dev and schnell) or unet (every UNet family); LoraError for a
    transformer family none of them reads (FLUX.2, Z-Image), whose LoRAs the UNet's loader would misread."""
    from ..core.families import TRANSFORMERS

    if family in TRANSFORMERS.values() and family not in LORA_FAMILIES:
        model = next(name for name, kind in TRANSFORMERS.items() if kind == family)
        built = ", ".join(f.label for f in LORA_FAMILIES.values())
        raise LoraError(
            f"LoRAs on a {family} model ({model}) are not built yet (sdtrt applies {built} ones): load the LoRA into "
            "the PyTorch pipeline with diffusers' load_lora_weights"
        )
    return next((kind for kind in ("sd3", "flux") if family.startswith(kind)), "unet")


def named_kind(keys: Sequence[str]) -> str | None:
    """The kind of model a LoRA's key names say it is for (FAMILY_MARKERS), or None where they do not say."""
    return next((kind for kind in FAMILY_MARKERS if marked(keys, kind)), None)


def marked(keys: Sequence[str], kind: str) -> str | None:
    """The first key that names a module only ``kind``'s LoRAs have."""
    return next((k for k in keys if re.search(FAMILY_MARKERS[kind], k)), None)


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
    format: str  # "diffusers (PEFT)", "diffusers (legacy)", "kohya"
    family: str  # the LoraFamily label it was read as: "UNet (SD 1.x/2.x, SDXL)", "SD3", "Flux"
    parts: dict[str, dict[str, LoraModule]]  # network (LORA_COMPONENTS) → module name → its low-rank pair


def _format(keys: list[str]) -> str | None:
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya"
    if any(".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers (PEFT)"
    if any(".lora.down." in k or "lora_linear_layer" in k or "_lora.down." in k for k in keys):
        return "diffusers (legacy)"
    return None


def read_lora(path: str | os.PathLike[str], family: str | None = None) -> LoraFile:
    """A LoRA file's parts, network by network, in PEFT form, read with the loader of ``family`` (the model's,
    ModelSource.family(); None: the kind the file's names say). LoraError naming the first thing sdtrt cannot
    use, a file for another kind of model included."""
    import safetensors

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
    lora_family = LORA_FAMILIES[_kind_for(path, keys, family)]
    state_dict, alphas, metadata = _lora_state_dict(path, lora_family)
    networks = lora_family.networks
    if other := next((k for k in state_dict if not k.startswith(tuple(f"{c}." for c in networks))), None):
        # CLIP's weights are under text_model. (T5's under encoder.): CLIP layers for a network this family has
        # as T5 (Flux's text_encoder_2) or lacks are from another family's LoRA (SD3's, SDXL's).
        why = (
            "a CLIP encoder's weight: a LoRA for another model (SD3, SDXL)?"
            if ".text_model." in other
            else "T5 encoders take none, as in diffusers"
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
    return LoraFile(path, kind, lora_family.label, parts)


def _kind_for(path: Path, keys: list[str], family: str | None) -> str:
    """The LORA_FAMILIES key to read a file with: the model family's; LoraError where the file's names say it
    is for another kind of model (before diffusers' converters fail on them, or a LoRA lands where it fits by
    chance)."""
    named = named_kind(keys)
    if family is None:
        return named or ("sd3" if any(k.startswith("transformer.") for k in keys) else "unet")
    kind = lora_kind(family)
    if named not in (None, kind):
        raise LoraError(f"{path} is a {LORA_FAMILIES[named].label} LoRA ('{marked(keys, named)}'); this model "
                        f"({family}) takes {LORA_FAMILIES[kind].label} LoRAs")  # fmt: skip
    return kind


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
            config = LoraConfig(
                r=rank, lora_alpha=alpha, target_modules=RANDOM_TARGETS[network], init_lora_weights=False
            )
            module.add_adapter(config)
            layers[f"{network}_lora_layers"] = get_peft_model_state_dict(module)
            layers[f"{network}_lora_adapter_metadata"] = config.to_dict()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp:
        pipeline.save_lora_weights(tmp, weight_name=out.name, **layers)
        follow_umask(Path(tmp))  # written 0600 (a temporary file), as the store's artifacts are not
        os.replace(Path(tmp) / out.name, out)
    return out
