"""PEFT's ``add_adapter(LoraConfig, adapter_name)`` on an engine stand-in (UNet, transformer, CLIP text encoder): the
LoRA weights PEFT makes for that config become an adapter of the pipeline's LoRA API (standins/adapters.py), so
``set_adapters``, ``fuse_lora``, ``delete_adapters`` and ``unload_lora_weights`` treat it as a loaded one.

PEFT makes the weights itself: ``inject_adapter_in_model`` on a weightless copy of the network (built from its config
on the meta device, each parameter one element broadcast to its shape), so target modules, ranks, alphas, patterns
and ``init_lora_weights`` are PEFT's, and the weights draw from torch's RNG as a PyTorch network's ``add_adapter``
draws them: a seeded caller gets the same LoRA. As in PEFT, the new adapter becomes the network's only active one;
the other networks keep theirs. What an engine's weights cannot hold (LoRA variants such as DoRA and aLoRA, LoRA
biases, whole modules trained, an initialisation from the base weights) is refused in one line before anything changes.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.errors import LoraError, one_line
from ..lora.files import LORA_COMPONENTS, Scale, network_scale
from .adapter_files import added, own_file
from .adapter_registry import PIPELINES, adapters, commit, engine_networks, holder, not_fused

# Random draws, as PEFT makes them from nothing but the shapes; the other values start from the base weights (PiSSA,
# OLoRA, LoftQ, EVA, CorDA, LoRA-GA) or make a LoRA variant (MiCA).
PLAIN_INITS = (True, False, "gaussian", "orthogonal")
# What the LoRA variants PEFT marks (``is_lora_variant``: DoRA, aLoRA, VeLoRA …) ask for, where it has a short name.
VARIANTS = {"use_dora": "DoRA", "alora_invocation_tokens": "aLoRA"}
# Other LoraConfig fields an engine's weights cannot honour: field → what it asks for.
UNSUPPORTED = {
    "lora_bias": "a LoRA bias",
    "modules_to_save": "whole modules trained beside the LoRA",
    "trainable_token_indices": "trainable token embeddings",
    "target_parameters": "LoRAs on bare parameters",
    "layer_replication": "replicated layers",
}
TAKES = "engines take plain LoRAs: leave it out, or pipe.load_lora_weights a plain LoRA file"


class PeftAdapters:
    """``add_adapter`` and ``peft_config`` on a stand-in whose engine weights LoRAs change; placed before the
    diffusers/transformers class in a stand-in's bases, so EngineModule does not refuse it."""

    def add_adapter(self, adapter_config: Any, adapter_name: str | None = None) -> None:
        add_adapter(self, adapter_config, adapter_name or "default")

    @property
    def peft_config(self) -> dict[str, Any] | None:
        """adapter name → the LoraConfig ``add_adapter`` was given, for the adapters added to this network and still
        loaded (None when there are none, as on a PyTorch network without adapters)."""
        pipe = pipeline_of(self)
        if pipe is None:
            return None
        loaded = adapters(pipe).files
        component = component_of(pipe, self)
        configs = {n: by_network[component] for n, (path, by_network) in added(holder(pipe)).items()
                   if loaded.get(n) == path and component in by_network}  # fmt: skip
        return configs or None


def add_adapter(network: Any, config: Any, name: str) -> None:
    """PEFT's adapter ``name`` for ``config`` on ``network``, as the pipeline's adapter ``name`` (its other networks'
    part included, where ``add_adapter`` gave them one), the network's only active adapter."""
    where = f"{type(network).__name__}.add_adapter"
    pipe = pipeline_of(network)
    if pipe is None:
        raise LoraError(f"{where} registers the adapter with the engine's pipeline, and it is in none: make the "
                        "pipeline first (sdtrt.load_pipeline), then add_adapter or pipe.load_lora_weights")  # fmt: skip
    refuse_unsupported(config, where)
    component = component_of(pipe, network)
    state = adapters(pipe)
    not_fused(pipe, state, "add_adapter")
    owner = holder(pipe)
    path, configs = added(owner).get(name, (None, {}))
    if state.files.get(name) != path:  # deleted, unloaded or hotswapped since: not the file add_adapter wrote
        configs = {}
    if name in state.files and not configs:
        raise LoraError(f"{where}: adapter name {name!r} is in use (pipe.load_lora_weights); delete_adapters({name!r}) "
                        "first, or choose another name")  # fmt: skip
    if component in configs:  # as PEFT: one adapter of a name per network
        raise LoraError(f"{where}: adapter {name!r} already exists in the {component}; choose another name")
    layers = {c: network_layers(state.files[name], c) for c in configs}  # the parts add_adapter made before
    layers[component] = peft_state_dict(network, config, name, where)
    configs = {**configs, component: copy.deepcopy(config)}
    path = own_file(owner, name)
    type(pipe).save_lora_weights(
        path.parent, weight_name=path.name, **{f"{c}_lora_layers": c_layers for c, c_layers in layers.items()},
        **{f"{c}_lora_adapter_metadata": c_config.to_dict() for c, c_config in configs.items()},
    )  # fmt: skip
    active = made_active(state.active, name, component, list(engine_networks(pipe)))
    weight = {c: 1.0 if c == component else network_scale(state.weights.get(name, 1.0), c) for c in LORA_COMPONENTS}
    new = replace(state, files={**state.files, name: path}, parts={**state.parts, name: tuple(configs)},
                  active=active, weights={**state.weights, name: weight})  # fmt: skip
    try:
        commit(pipe, new)
    except LoraError as exc:  # the file is sdtrt's own: name the adapter instead
        path.unlink(missing_ok=True)
        raise LoraError(f"{where}: {str(exc).replace(str(path), f'adapter {name!r}')}") from exc
    added(owner)[name] = (path, configs)


def network_layers(path: Path, component: str) -> dict[str, Any]:
    """One network's PEFT state dict from the file save_lora_weights wrote."""
    from safetensors.torch import load_file

    prefix = f"{component}."
    return {k.removeprefix(prefix): v for k, v in load_file(path).items() if k.startswith(prefix)}


def refuse_unsupported(config: Any, where: str) -> None:
    import dataclasses

    from peft import LoraConfig

    if not isinstance(config, LoraConfig):
        raise LoraError(f"{where} on engines takes a peft LoraConfig, not a {type(config).__name__}; {TAKES}")
    fields = {field.name: field for field in dataclasses.fields(config)}
    marked = (name for name, field in fields.items() if field.metadata.get("is_lora_variant"))
    if variant := next((name for name in marked if getattr(config, name)), None):
        raise LoraError(f"{where}: {variant} asks for a LoRA variant, {VARIANTS.get(variant, variant)}, which an "
                        f"engine cannot hold; {TAKES}")  # fmt: skip
    if config.init_lora_weights in fields["init_lora_weights"].metadata.get("lora_variants", ()):
        raise LoraError(f"{where}: init_lora_weights={config.init_lora_weights!r} asks for a LoRA variant, which an "
                        f"engine cannot hold; {TAKES}")  # fmt: skip
    if asked := next((field for field in UNSUPPORTED if getattr(config, field, None)), None):
        raise LoraError(f"{where}: {asked} asks for {UNSUPPORTED[asked]}, which an engine cannot hold; {TAKES}")
    if config.init_lora_weights not in PLAIN_INITS:
        raise LoraError(f"{where}: init_lora_weights={config.init_lora_weights!r} starts from the base weights, "
                        "which sdtrt does not load beside the engine: use True, False, 'gaussian' or 'orthogonal'; "
                        f"{TAKES}")  # fmt: skip


def peft_state_dict(network: Any, config: Any, name: str, where: str) -> dict[str, Any]:
    """The adapter's weights as PEFT makes them, by PEFT's names (``<module>.lora_A.weight``), with no base weights."""
    import torch
    from peft import inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    from .base import pytorch_class

    cls = pytorch_class(network)
    with torch.device("meta"):  # no memory, no random draws: the caller's RNG is left for PEFT's own
        skeleton = cls.from_config(network.config) if hasattr(cls, "from_config") else cls(network.config)
    for module in skeleton.modules():  # PEFT reads a base weight's device, dtype and shape, never its values
        for key, param in list(module.named_parameters(recurse=False)):
            weightless = torch.empty_strided(param.shape, [0] * param.dim(), dtype=param.dtype)
            setattr(module, key, torch.nn.Parameter(weightless, requires_grad=False))
    try:
        inject_adapter_in_model(copy.deepcopy(config), skeleton, name)
    except ValueError as exc:  # "Target modules {...} not found in the base model …"
        raise LoraError(f"{where}: {one_line(exc)}") from exc
    return get_peft_model_state_dict(skeleton, adapter_name=name)


def made_active(active: tuple[tuple[str, Scale], ...], name: str, component: str, components: list[str]) -> tuple:
    """PEFT's set_adapter on one network: ``name`` runs there alone, at 1.0; elsewhere every adapter keeps its weight
    (``name`` too, 0 where it was not active). A weight that is the same on every network is one number."""
    before = dict(active)
    weights = {n: {c: network_scale(w, c) for c in components} for n, w in active}
    weights[name] = {c: network_scale(before[name], c) if name in before else 0.0 for c in components}
    for n, by_network in weights.items():
        by_network[component] = 1.0 if n == name else 0.0
    out = []
    for n, by_network in weights.items():
        values = set(by_network.values())
        if values != {0.0}:  # active on no network: not active
            out.append((n, values.pop() if len(values) == 1 else by_network))
    return tuple(out)


def pipeline_of(network: Any) -> Any:
    """The newest live pipeline ``network`` is in (still one of its networks), or None."""
    live = (ref() for ref in reversed(network.__dict__.get(PIPELINES, [])))
    return next((pipe for pipe in live if pipe is not None and component_of(pipe, network)), None)


def component_of(pipe: Any, network: Any) -> str:
    """The component ``network`` is in ``pipe`` ("" where it is none of its engine networks)."""
    return next((c for c, n in engine_networks(pipe).items() if n is network), "")
