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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.errors import LoraError
from ..lora.files import (
    DIFFUSERS_LORA_FILE,
    LORA_COMPONENTS,
    LoraSpec,
    Scale,
    for_network,
    network_scale,
    read_lora,
)
from ..lora.refit import EngineLoras, LoraNetwork, apply_loras
from .adapter_files import saved_state_dict

# Held by the pipeline's first engine network (its denoiser's stand-in, usually), not by the pipeline: pipelines made
# from one another (from_pipe, Pipeline(**pipe.components)) share the engines, and so their adapters.
REGISTRY = "_sdtrt_lora_adapters"  # the Adapters
PIPELINES = "_sdtrt_pipelines"  # held by each engine network: weak references to the pipelines it is in
ADAPTER_METHODS = (
    "load_lora_weights", "set_adapters", "get_active_adapters", "get_list_adapters", "delete_adapters",
    "unload_lora_weights", "disable_lora", "enable_lora", "fuse_lora", "unfuse_lora", "enable_lora_hotswap",
)  # fmt: skip
LOAD_KWARGS = {"weight_name", "subfolder", "low_cpu_mem_usage", "local_files_only"}  # others are refused


NO_ENGINE = "this pipeline runs no network on an engine; load_pipeline(model, loras=…) fuses LoRAs into PyTorch"


def lora_networks(pipe: Any) -> list[EngineLoras]:
    """The LoRAs of each engine network in ``pipe`` that takes them (UNet, text encoders), and of the transformer's
    split members (a step cache's) after the transformer's own."""
    networks = (getattr(pipe, c, None) for c in LORA_COMPONENTS)
    return [loras for n in networks if isinstance(n, LoraNetwork) for loras in n.engine_loras()]


def apply_pipeline_loras(pipe: Any, loras: Sequence[LoraSpec]) -> None:
    """``sdtrt.set_loras``'s work: these (file, scale) LoRAs into every engine network of ``pipe``, from base."""
    networks = lora_networks(pipe)
    if not networks:
        raise LoraError(NO_ENGINE)

    def elsewhere(network: str) -> str:
        if getattr(pipe, network, None) is None:  # an SDXL LoRA's second text encoder on an SD 1.x pipeline
            return ", which this pipeline does not have: a LoRA for another architecture?"
        return ", which runs on PyTorch in this pipeline: load an engine set that has it (sdtrt compile)"

    apply_loras(networks, loras, elsewhere)


@dataclass(frozen=True)
class Adapters:
    """One pipeline's adapters: name → file, which are active at what weight, enabled, fused ones, and ``baked``:
    LoRAs in the weights that no adapter names (set_loras' or load_pipeline's, or fused then unloaded)."""

    files: dict[str, Path] = field(default_factory=dict)  # in load order
    parts: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name → the networks its file changes
    active: tuple[tuple[str, Scale], ...] = ()  # a weight, or one per network (every network the pipeline has)
    enabled: bool = True
    fused: tuple[tuple[str, Scale], ...] | None = None  # the fused adapters, at the weights fused; None: not fused
    baked: tuple[tuple[Path, Scale], ...] = ()
    call_scale: Scale = 1.0  # a pipeline call's LoRA scale: it multiplies the active adapters that are not fused

    def loras(self) -> list[tuple[Path, Scale]]:
        """The (file, scale) list the engines run in this state."""
        # fused adapters are in the weights: a call's scale leaves them as they are (PEFT's merged layers)
        running = [(n, scaled(w, self.call_scale)) for n, w in self.active] if self.fused is None else self.fused
        if not self.enabled:
            running = []
        return [*self.baked, *((self.files[n], w) for n, w in running)]


def adapters(pipe: Any) -> Adapters:
    """``pipe``'s registry; a new one takes the LoRAs its engines run now (set_loras') as baked, and so does one
    whose LoRAs the engines no longer run (a network's own ``set_loras`` changed them since)."""
    found = registry(pipe)
    networks = lora_networks(pipe)
    if found is None or any(for_network(found.loras(), n.component) != n.active for n in networks):
        found = Adapters(baked=tuple(running_loras(networks)))
    return found


def running_loras(networks: list[EngineLoras]) -> list[tuple[Path, Scale]]:
    """The LoRAs the engines run now: one list where every network runs the same, else each file's scale per network
    (0 on a network that does not run it)."""
    lists = [n.active for n in networks]
    if all(active == lists[0] for active in lists):
        return list(lists[0]) if lists else []
    scales: dict[Path, dict[str, float]] = {}
    for network in networks:
        for path, scale in network.active:
            scales.setdefault(path, {})[network.component] = scale
    components = {n.component for n in networks}
    return [(path, {c: by_network.get(c, 0.0) for c in components}) for path, by_network in scales.items()]


def commit(pipe: Any, state: Adapters) -> None:
    """Put ``state``'s LoRAs into the engines; only then does the registry take it."""
    apply_pipeline_loras(pipe, state.loras())
    holder(pipe).__dict__[REGISTRY] = state
    set_call_scale(pipe, state.call_scale)
    pipe._merged_adapters = {n for n, _ in state.fused or ()}  # what diffusers' fused_loras / num_fused_loras read


def engine_networks(pipe: Any) -> dict[str, LoraNetwork]:
    """The pipeline's engine networks that take LoRAs, by component."""
    networks = {c: getattr(pipe, c, None) for c in LORA_COMPONENTS}
    return {c: n for c, n in networks.items() if isinstance(n, LoraNetwork)}


def holder(pipe: Any) -> Any:
    """What holds the pipeline's adapters: its first engine network, which pipelines made from it share (apply_loras
    refuses a pipeline with none before anything is held)."""
    networks = engine_networks(pipe)
    if not networks:
        raise LoraError(NO_ENGINE)
    return next(iter(networks.values()))


def registry(pipe: Any) -> Adapters | None:
    """The adapters its holder keeps, or None (none loaded, or no engine network)."""
    networks = engine_networks(pipe)
    return next(iter(networks.values())).__dict__.get(REGISTRY) if networks else None


def set_call_scale(pipe: Any, scale: Scale) -> None:
    """Tell the engine networks which call scale their weights hold (they refuse a call with another)."""
    for component, network in engine_networks(pipe).items():
        network.call_scale = network_scale(scale, component)


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
    attention = getattr(pipe, "_joint_attention_kwargs", None) or getattr(pipe, "_cross_attention_kwargs", None)
    given = (attention or {}).get("scale")
    denoiser = "transformer" if getattr(pipe, "transformer", None) is not None else "unet"
    return 1.0 if given is None else {denoiser: float(given)}


def forget(pipe: Any) -> None:
    """After a direct set_loras: its LoRAs are the new baked ones, no adapters remain."""
    for network in engine_networks(pipe).values():
        network.__dict__.pop(REGISTRY, None)


def _names(pipe: Any, state: Adapters, names: str | Sequence[str], method: str) -> list[str]:
    names = [names] if isinstance(names, str) else list(names)
    if missing := [n for n in names if n not in state.files]:
        raise LoraError(  # diffusers' words for it, which code written against diffusers may look for
            f"{type(pipe).__name__}.{method}: adapter {', '.join(map(repr, missing))} not in the list of present "
            f"adapters; loaded: {', '.join(state.files) or 'none'}"
        )
    return names


def _not_fused(pipe: Any, state: Adapters, method: str) -> None:
    if state.fused is not None:
        raise LoraError(f"{type(pipe).__name__}.{method} on fused adapters: call unfuse_lora() first")


def load_lora_weights(
    pipe: Any, pretrained_model_name_or_path_or_dict: Any, adapter_name: str | None = None, hotswap: bool = False,
    **kwargs: Any,
) -> None:  # fmt: skip
    """A LoRA file, folder or state dict as a new adapter, the only active one, at weight 1.0 (diffusers' behaviour);
    with ``hotswap``, as the new weights of the adapter ``adapter_name``, which keeps its place at weight 1.0."""
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
    _not_fused(pipe, state, "load_lora_weights")
    if hotswap and name not in state.files:
        raise LoraError(f"{where}: hotswap replaces a loaded adapter, and {name!r} is none; loaded: "
                        f"{', '.join(state.files) or 'none'}")  # fmt: skip
    if name in state.files and not hotswap:
        raise LoraError(f"{where}: adapter name {name!r} is already in use; delete_adapters({name!r}) first, or "
                        "load_lora_weights(..., hotswap=True) to replace it")  # fmt: skip
    networks = lora_networks(pipe)
    try:
        lora = read_lora(path, networks[0].family if networks else None)
        if hotswap and (encoders := [c for c in lora.parts if c.startswith("text_encoder")]):
            raise LoraError(f"{where}: hotswap replaces denoiser adapters only, as in diffusers, and {path} changes "
                            f"the {encoders[0]}: pass hotswap=False")  # fmt: skip
        # A hotswapped adapter keeps its place among the active ones, at weight 1.0 (PEFT's hotswap resets its scaling).
        active = tuple((n, 1.0 if n == name else w) for n, w in state.active) if hotswap else ((name, 1.0),)
        new = replace(state, files={**state.files, name: path}, parts={**state.parts, name: tuple(lora.parts)},
                      active=active)  # fmt: skip
        commit(pipe, new)
    except LoraError as exc:
        if not isinstance(pretrained_model_name_or_path_or_dict, dict):
            raise
        # The file is sdtrt's own copy of the state dict: name what the user gave instead.
        raise LoraError(str(exc).replace(str(path), f"the state dict of adapter {name!r}")) from exc


def enable_lora_hotswap(pipe: Any, **kwargs: Any) -> None:
    """Nothing to prepare on engines: a hotswapped LoRA is refit into the same engines, at any rank, with no
    recompilation (what diffusers' enable_lora_hotswap prepares PyTorch adapter layers for)."""


def set_adapters(pipe: Any, adapter_names: str | Sequence[str], adapter_weights: Any = None) -> None:
    """Make these adapters the active ones, at these weights (1.0 each when None; one number for all)."""
    state = adapters(pipe)
    names = _names(pipe, state, adapter_names, "set_adapters")
    _not_fused(pipe, state, "set_adapters")
    if isinstance(adapter_weights, dict):  # one dict for every adapter: others' components are dropped, as diffusers
        adapter_weights = known_components(pipe, adapter_weights)
    weights = adapter_weights if isinstance(adapter_weights, list | tuple) else [adapter_weights] * len(names)
    if len(weights) != len(names):
        raise LoraError(f"set_adapters: {len(names)} adapter names and {len(weights)} weights; give one weight each")
    active = tuple((n, adapter_weight(pipe, w)) for n, w in zip(names, weights, strict=True))
    commit(pipe, replace(state, active=active))


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
    _not_fused(pipe, state, "delete_adapters")
    files = {n: p for n, p in state.files.items() if n not in names}
    parts = {n: p for n, p in state.parts.items() if n not in names}
    commit(pipe, replace(state, files=files, parts=parts, active=tuple(a for a in state.active if a[0] not in names)))


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
    """Run the fused adapters (``adapter_names``, else the active ones) with every active weight × ``lora_scale``; an
    inactive adapter named fuses at ``lora_scale`` (PEFT merges it at its layers' scaling, 1.0 unless set before)."""
    state = adapters(pipe)
    _not_fused(pipe, state, "fuse_lora")
    if components is not None and set(get_list_adapters(pipe)) - set(components):
        raise LoraError("fuse_lora: fusing some components only needs PyTorch adapter layers; on engines leave "
                        "components out (every network the adapters change is fused)")  # fmt: skip
    names = _names(pipe, state, adapter_names, "fuse_lora") if adapter_names else [n for n, _ in state.active]
    active = {n: scaled(w, lora_scale) for n, w in state.active}  # PEFT's scale_layer, kept after unfuse
    fused = tuple((n, active.get(n, lora_scale)) for n in names)
    commit(pipe, replace(state, active=tuple(active.items()), fused=fused))


def scaled(weight: Scale, factor: Scale) -> Scale:
    """An adapter's weight times a factor, either of them one number or one per network."""
    if not isinstance(weight, Mapping) and not isinstance(factor, Mapping):
        return weight * factor
    return {c: network_scale(weight, c) * network_scale(factor, c) for c in LORA_COMPONENTS}


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
