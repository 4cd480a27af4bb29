"""The adapter registry of an engine pipeline (diffusers' LoRA API on engines, standins/adapters.py): which adapters are
loaded from which files, which run at what weights, and ``commit``, which puts a state's LoRAs into the engines before
the registry takes it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.errors import LoraError
from ..lora.files import LORA_COMPONENTS, LoraSpec, Scale, for_network, network_scale
from ..lora.refit import EngineLoras, LoraNetwork, apply_loras
from .adapter_files import drop_unused

# Held by the pipeline's first engine network (its denoiser's stand-in, usually), not by the pipeline: pipelines made
# from one another (from_pipe, Pipeline(**pipe.components)) share the engines, and so their adapters.
REGISTRY = "_sdtrt_lora_adapters"  # the Adapters
PIPELINES = "_sdtrt_pipelines"  # held by each engine network: weak references to the pipelines it is in
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
    # Each adapter's weight as its PEFT layers keep it, per network, active or not: the last set_adapters gave it (1.0
    # when loaded or added, × lora_scale where fuse_lora scaled it). fuse_lora(adapter_names=…) fuses an inactive
    # adapter at it, as PEFT's merge does.
    weights: dict[str, Scale] = field(default_factory=dict)

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
    drop_unused_files(pipe, state)


def drop_unused_files(pipe: Any, state: Adapters | None) -> None:
    """Remove the pipeline's own LoRA files that no adapter, baked LoRA or engine reads any more."""
    files = set(state.files.values()) if state is not None else set()
    baked = {path for path, _ in state.baked} if state is not None else set()
    running = {path for network in lora_networks(pipe) for path, _ in network.active}
    drop_unused(holder(pipe), files | baked | running, files)


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


def forget(pipe: Any) -> None:
    """After a direct set_loras: its LoRAs are the new baked ones, no adapters remain."""
    for network in engine_networks(pipe).values():
        network.__dict__.pop(REGISTRY, None)
    drop_unused_files(pipe, None)


def not_fused(pipe: Any, state: Adapters, method: str) -> None:
    if state.fused is not None:
        raise LoraError(f"{type(pipe).__name__}.{method} on fused adapters: call unfuse_lora() first")


def scaled_where_running(weight: Scale, running: Scale, factor: float) -> Scale:
    """An adapter's kept weight after PEFT's ``scale_layer(factor)``: times ``factor`` on the networks it runs on
    (``running``, its active weight, not 0 there), as it was on the others."""
    if not isinstance(weight, Mapping) and not isinstance(running, Mapping):
        return weight * factor if running != 0 else weight
    return {c: network_scale(weight, c) * (factor if network_scale(running, c) != 0 else 1.0) for c in LORA_COMPONENTS}


def scaled(weight: Scale, factor: Scale) -> Scale:
    """An adapter's weight times a factor, either of them one number or one per network."""
    if not isinstance(weight, Mapping) and not isinstance(factor, Mapping):
        return weight * factor
    return {c: network_scale(weight, c) * network_scale(factor, c) for c in LORA_COMPONENTS}
