"""diffusers' LoRA API (``load_lora_weights``, ``set_adapters``, ``fuse_lora`` …) on a pipeline whose networks are
engines, mapped onto ``set_loras``: each call computes the (file, scale) list its adapters now mean and puts it into
the engines in one ``apply_pipeline_loras``, so a LoRA that does not fit is one LoraError and the pipeline (and its
adapter registry) stays as it was.

The registry mirrors diffusers 0.42 with PEFT: loading an adapter makes it the only active one, at weight 1.0;
``set_adapters`` chooses the active ones and their weights (1.0 where none is given); ``disable_lora`` runs the
engines without the adapters until ``enable_lora``; ``fuse_lora(lora_scale)`` multiplies the active adapters' weights
by ``lora_scale`` (PEFT's ``scale_layer``, kept after ``unfuse_lora`` as in diffusers) and runs only the fused ones;
``unload_lora_weights`` forgets the adapters and keeps what was fused in the weights, as diffusers does. On engines
fused and active weights are the same weights: only which LoRAs, at what scales, differs.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.errors import LoraError
from ..lora.files import DIFFUSERS_LORA_FILE, LORA_COMPONENTS, LoraFile, Scale, network_scale, read_lora
from .adapter_files import combined_file, saved_state_dict
from .adapter_registry import (
    PIPELINES,
    Adapters,
    adapters,
    commit,
    engine_networks,
    holder,
    lora_networks,
    not_fused,
    registry,
    scaled,
    scaled_where_running,
    set_call_scale,
)

ADAPTER_METHODS = (
    "load_lora_weights", "set_adapters", "get_active_adapters", "get_list_adapters", "delete_adapters",
    "unload_lora_weights", "disable_lora", "enable_lora", "fuse_lora", "unfuse_lora", "enable_lora_hotswap",
)  # fmt: skip
LOAD_KWARGS = {"weight_name", "subfolder", "low_cpu_mem_usage", "local_files_only"}  # others are refused


def with_call_scale(pipe: Any, encode_prompt: Any) -> Any:
    """The pipeline's encode_prompt, which its call runs first with the call's LoRA scale (``lora_scale``, from
    cross_attention_kwargs or joint_attention_kwargs): that scale goes into the engines before anything runs, as
    PEFT scales its adapter layers for the call. A pipeline that passes no ``lora_scale`` but gives its denoiser one
    (SD3's inpainting) scales the denoiser's adapters only, as on PyTorch."""

    def encode(*args: Any, **kwargs: Any) -> Any:
        scale = call_scale_of(pipe, kwargs.get("lora_scale"))
        state = registry(pipe)
        if state is not None and state.call_scale != scale:
            commit(pipe, replace(adapters(pipe), call_scale=scale))
        elif state is None:  # no adapters: the scale changes nothing, as on PyTorch (set_loras' LoRAs are fused ones)
            set_call_scale(pipe, scale)
        return encode_prompt(*args, **kwargs)

    return encode


def call_scale_of(pipe: Any, lora_scale: float | None) -> Scale:
    """This call's LoRA scale: ``lora_scale`` for every network, else the denoiser's attention kwargs' for the
    denoiser alone, else 1.0."""
    if lora_scale is not None:
        return float(lora_scale)
    attention = next((given for name in ("_joint_attention_kwargs", "_cross_attention_kwargs", "_attention_kwargs")
                      if (given := getattr(pipe, name, None))), None)  # FLUX.2's: attention_kwargs  # fmt: skip
    given = (attention or {}).get("scale")
    denoiser = "transformer" if getattr(pipe, "transformer", None) is not None else "unet"
    return 1.0 if given is None else {denoiser: float(given)}


def _names(pipe: Any, state: Adapters, names: str | Sequence[str], method: str) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    if missing := [n for n in names if n not in state.files]:
        raise LoraError(  # diffusers' words for it, which code written against diffusers may look for
            f"{type(pipe).__name__}.{method}: adapter {', '.join(map(repr, missing))} not in the list of present "
            f"adapters; loaded: {', '.join(state.files) or 'none'}"
        )
    return names


def load_lora_weights(
    pipe: Any, pretrained_model_name_or_path_or_dict: Any, adapter_name: str | None = None, hotswap: bool = False,
    **kwargs: Any,
) -> None:  # fmt: skip
    """A LoRA file, folder or state dict as a new adapter, the only active one, at weight 1.0 (diffusers' behaviour);
    with ``hotswap``, as the new weights of adapter ``adapter_name`` on the networks the file changes."""
    where = f"{type(pipe).__name__}.load_lora_weights"
    source = pretrained_model_name_or_path_or_dict
    if unknown := sorted(set(kwargs) - LOAD_KWARGS):
        raise LoraError(f"{where} on engines takes no {', '.join(unknown)}")
    state = adapters(pipe)
    name = adapter_name or f"default_{len(state.files)}"
    if isinstance(source, dict):  # refit reads LoRAs from files: the state dict becomes one, the pipeline's own
        source = saved_state_dict(holder(pipe), source, name, where)
    if not isinstance(source, str | os.PathLike):
        raise LoraError(f"{where} on engines reads a LoRA file or folder on disk, or a state dict of tensors, not a "
                        f"{type(source).__name__}")  # fmt: skip
    path = Path(source) / kwargs.get("subfolder", "")
    if path.is_dir():
        path = path / (kwargs.get("weight_name") or DIFFUSERS_LORA_FILE)
    if not path.is_file():
        raise LoraError(f"{where}: {path} is no LoRA file on disk; sdtrt reads LoRAs from disk only: download a Hub "
                        "LoRA first (huggingface_hub.hf_hub_download)")  # fmt: skip
    not_fused(pipe, state, "load_lora_weights")
    if hotswap and name not in state.files:
        raise LoraError(f"{where}: hotswap replaces a loaded adapter, and {name!r} is none; loaded: "
                        f"{', '.join(state.files) or 'none'}")  # fmt: skip
    if name in state.files and not hotswap:
        raise LoraError(f"{where}: adapter name {name!r} is already in use; delete_adapters({name!r}) first, or "
                        "load_lora_weights(..., hotswap=True) to replace it")  # fmt: skip
    networks = lora_networks(pipe)
    family = networks[0].family if networks else None
    try:
        lora = read_lora(path, family)
        if hotswap and (encoders := [c for c in lora.parts if c.startswith("text_encoder")]):
            raise LoraError(f"{where}: hotswap replaces denoiser adapters only, as in diffusers, and {path} changes "
                            f"the {encoders[0]}: pass hotswap=False")  # fmt: skip
        if hotswap:
            new = hotswapped(pipe, state, name, lora, family)
        else:
            new = replace(state, files={**state.files, name: path}, parts={**state.parts, name: tuple(lora.parts)},
                          active=((name, 1.0),), weights={**state.weights, name: 1.0})  # fmt: skip
        commit(pipe, new)
    except LoraError as exc:
        if not isinstance(pretrained_model_name_or_path_or_dict, dict):
            raise
        # The file is sdtrt's own copy of the state dict: name what the user gave instead.
        raise LoraError(str(exc).replace(str(path), f"the state dict of adapter {name!r}")) from exc


def hotswapped(pipe: Any, state: Adapters, name: str, lora: LoraFile, family: str | None) -> Adapters:
    """``state`` with ``lora`` as adapter ``name``'s weights on the networks it changes, at weight 1.0 there (PEFT's
    hotswap resets their scaling; a network the adapter is inactive on stays so); on its other networks the adapter
    keeps its weights, as diffusers hotswaps only the networks a file has. Its place among the active ones stays."""
    swapped = set(lora.parts)
    path = lora.path
    if kept := [c for c in state.parts[name] if c not in swapped]:
        path = combined_file(holder(pipe), name, lora, read_lora(state.files[name], family), kept)
    parts = (*lora.parts, *kept)

    def reset(weight: Scale, inactive_stays: bool) -> Scale:
        by_network = {c: network_scale(weight, c) for c in LORA_COMPONENTS}
        for c in swapped:
            by_network[c] = 0.0 if inactive_stays and by_network[c] == 0 else 1.0
        values = set(by_network.values())
        return values.pop() if len(values) == 1 else by_network

    active = tuple((n, reset(w, True) if n == name else w) for n, w in state.active)
    weights = {**state.weights, name: reset(state.weights.get(name, 1.0), False)}
    return replace(state, files={**state.files, name: path}, parts={**state.parts, name: parts}, active=active,
                   weights=weights)  # fmt: skip


def enable_lora_hotswap(pipe: Any, **kwargs: Any) -> None:
    """Nothing to prepare on engines: a hotswapped LoRA is refit into the same engines, at any rank, with no
    recompilation (what diffusers' enable_lora_hotswap prepares PyTorch adapter layers for)."""


def set_adapters(pipe: Any, adapter_names: str | Sequence[str], adapter_weights: Any = None) -> None:
    """Make these adapters the active ones, at these weights (1.0 each when None; one number for all)."""
    state = adapters(pipe)
    names = _names(pipe, state, adapter_names, "set_adapters")
    not_fused(pipe, state, "set_adapters")
    if isinstance(adapter_weights, dict):  # one dict for every adapter: others' components are dropped, as diffusers
        adapter_weights = known_components(pipe, adapter_weights)
    weights = adapter_weights if isinstance(adapter_weights, list | tuple) else [adapter_weights] * len(names)
    if len(weights) != len(names):
        raise LoraError(f"set_adapters: {len(names)} adapter names and {len(weights)} weights; give one weight each")
    active = tuple((n, adapter_weight(pipe, w)) for n, w in zip(names, weights, strict=True))
    commit(pipe, replace(state, active=active, weights={**state.weights, **dict(active)}))


def known_components(pipe: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without the components the pipeline has none of, which diffusers' set_adapters warns about (in its
    words, on its logger) and ignores."""
    from diffusers.utils import logging

    components = type(pipe)._lora_loadable_modules
    if unknown := sorted(set(weights) - set(components)):
        logging.get_logger("diffusers.loaders.lora_base").warning(
            f"The following components in `adapter_weights` are not part of the pipeline: {unknown}. LoRA components: "
            f"{components}; the others' weights are ignored."
        )
    return {c: w for c, w in weights.items() if c in components}


def adapter_weight(pipe: Any, weight: Any) -> Scale:
    """An adapter's weight as set_adapters takes it: a number (None: 1.0), or one per component ({"unet": 0.5}; 1.0
    for a component it leaves out, as diffusers). Per-block weights (a component's dict) are refused: an engine takes
    one scale per network."""
    if not isinstance(weight, dict):
        return 1.0 if weight is None else weight
    components = type(pipe)._lora_loadable_modules
    if unknown := [c for c in weight if c not in components]:
        raise LoraError(f"set_adapters: {type(pipe).__name__} has no LoRA component {unknown[0]!r}; per-component "
                        f"weights name {', '.join(components)}")  # fmt: skip
    if blocks := next((c for c, w in weight.items() if isinstance(w, dict)), None):
        raise LoraError(f"set_adapters: per-block weights ({blocks!r}: a dict) need PyTorch adapter layers; on engines "
                        "give one number per adapter or per component")  # fmt: skip
    return {c: 1.0 if weight.get(c) is None else weight[c] for c in components}


def get_active_adapters(pipe: Any) -> list[str]:
    return [n for n, _ in adapters(pipe).active]


def get_list_adapters(pipe: Any) -> dict[str, list[str]]:
    """component → its adapters, in load order, for the components each adapter's file changes (as diffusers)."""
    state = adapters(pipe)
    out = {c: [n for n in state.files if c in state.parts[n]] for c in type(pipe)._lora_loadable_modules}
    return {c: names for c, names in out.items() if names}


def delete_adapters(pipe: Any, adapter_names: str | Sequence[str]) -> None:
    state = adapters(pipe)
    names = set(_names(pipe, state, adapter_names, "delete_adapters"))
    not_fused(pipe, state, "delete_adapters")
    files = {n: p for n, p in state.files.items() if n not in names}
    parts = {n: p for n, p in state.parts.items() if n not in names}
    active = tuple(a for a in state.active if a[0] not in names)
    weights = {n: w for n, w in state.weights.items() if n not in names}
    commit(pipe, replace(state, files=files, parts=parts, active=active, weights=weights))


def unload_lora_weights(pipe: Any) -> None:
    """No adapters left; what was fused stays in the weights (diffusers' fuse_lora + unload_lora_weights)."""
    state = adapters(pipe)
    kept = state.loras() if state.fused is not None and state.enabled else list(state.baked)
    commit(pipe, Adapters(baked=tuple(kept)))


def disable_lora(pipe: Any) -> None:
    commit(pipe, replace(adapters(pipe), enabled=False))


def enable_lora(pipe: Any) -> None:
    commit(pipe, replace(adapters(pipe), enabled=True))


def fuse_lora(
    pipe: Any, components: Sequence[str] | None = None, lora_scale: float = 1.0, safe_fusing: bool = False,
    adapter_names: Sequence[str] | None = None, **kwargs: Any,
) -> None:  # fmt: skip
    """Run the fused adapters with every active weight × ``lora_scale`` (PEFT's ``scale_layer``, kept after unfuse):
    the active ones, or those ``adapter_names`` names, an inactive one at the weight it keeps (PEFT's merge)."""
    state = adapters(pipe)
    not_fused(pipe, state, "fuse_lora")
    if components is not None and set(get_list_adapters(pipe)) - set(components):
        raise LoraError("fuse_lora: fusing some components only needs PyTorch adapter layers; on engines leave "
                        "components out (every network the adapters change is fused)")  # fmt: skip
    named = _names(pipe, state, adapter_names, "fuse_lora") if adapter_names else None
    running = dict(state.active)
    active = tuple((n, scaled(w, lora_scale)) for n, w in state.active)
    weights = {n: scaled_where_running(w, running.get(n, 0.0), lora_scale) for n, w in state.weights.items()}
    fused = active if named is None else tuple((n, weights[n]) for n in named)
    commit(pipe, replace(state, active=active, weights=weights, fused=fused))


def unfuse_lora(pipe: Any, components: Sequence[str] | None = None, **kwargs: Any) -> None:
    state = adapters(pipe)
    if state.fused is not None:
        commit(pipe, replace(state, fused=None))


def install(pipe: Any) -> None:
    """Bind the methods above to ``pipe``, in place of diffusers' PyTorch ones (those it has)."""
    for network in engine_networks(pipe).values():  # PEFT's add_adapter on a network registers with its pipeline
        pipelines = network.__dict__.setdefault(PIPELINES, [])
        if not any(ref() is pipe for ref in pipelines):
            pipelines.append(weakref.ref(pipe))
    functions = globals()
    for name in ADAPTER_METHODS:
        if hasattr(type(pipe), name):
            bound = functions[name].__get__(pipe)
            setattr(pipe, name, bound)
    if hasattr(type(pipe), "encode_prompt"):
        pipe.encode_prompt = with_call_scale(pipe, type(pipe).encode_prompt.__get__(pipe))
