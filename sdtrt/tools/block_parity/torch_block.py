"""The PyTorch block, loaded alone: the network built on the meta device, how its forward calls each block at the
check size (traced there), and one block made real from the model's shards."""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.errors import ArtifactError
from .scopes import module_scope
from .shapes import check_size
from .stored import StoredTensor

if TYPE_CHECKING:
    import torch

    from ...sources.models import ModelSource
    from ...spec import GraphSpec

# Tensor methods torch.export turns into copies or nothing, which the exporter's optimizer removes (when the result
# keeps the input's shape and dtype).
GRAPH_IDENTITIES = {"contiguous", "clone", "detach", "to", "type", "type_as", "float", "half", "bfloat16", "view",
                    "view_as", "reshape", "reshape_as", "expand", "expand_as"}  # fmt: skip


@dataclass
class BlockCall:
    """How the network calls a block at the check size, seen on the meta device: its bound arguments (tensors as
    meta tensors), its output, and the scope each tensor was made in (by id)."""

    arguments: dict[str, Any]
    output: Any
    made_in: dict[int, tuple[Any, str]]  # the tensor, kept so that its id is not reused, and its scope


def meta_network(model: ModelSource, folder: str) -> Any:
    """The network built from its config on the meta device: no weight memory, any size."""
    import importlib

    import torch

    from ...core.progress import quiet_loading

    library, class_name = model.component_class(folder)
    cls = getattr(importlib.import_module(library), class_name)
    config = model.component_config(folder)
    with quiet_loading(), torch.device("meta"):
        if library == "transformers":
            return cls(cls.config_class.from_dict(config)).eval()
        return cls.from_config(config).eval()


def trace_calls(network: Any, spec: GraphSpec, blocks: Sequence[str]) -> dict[str, BlockCall]:
    """Run the graph's forward on the meta device at the check size and record how each block is called."""
    import torch
    from torch.overrides import TorchFunctionMode

    from ...stages.graph_module import graph_module

    made_in: dict[int, tuple[Any, str]] = {}
    calls: dict[str, BlockCall] = {}
    handles = []
    running = [""]  # the scopes of the modules whose forward runs, as the exporter names them (module_scope)

    class RecordScopes(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            result = func(*args, **(kwargs or {}))
            scope = running[-1]
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if source is not None and id(source) in made_in and is_graph_identity(func, source, result):
                scope = made_in[id(source)][1]
            for _, tensor in tensor_leaves(result):
                made_in.setdefault(id(tensor), (tensor, scope))
            return result

    def enter(name: str) -> Any:
        return lambda module, args: running.append(module_scope(name))

    def leave(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            running.pop()
            if name in blocks:
                bound = inspect.signature(module.forward).bind(*args, **kwargs)
                calls[name] = BlockCall(dict(bound.arguments), output, made_in)

        return hook

    for name, module in network.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name), with_kwargs=True))
    batch, height, width, tokens = check_size(spec)
    feeds = spec.sample_inputs(batch, height, width, tokens=tokens)
    try:
        with torch.no_grad(), RecordScopes():
            graph_module(spec, network)(*(feeds[n].to("meta") for n in spec.input_names))
    finally:
        for handle in handles:
            handle.remove()
    if missing := [b for b in blocks if b not in calls]:
        raise ArtifactError(f"the network never calls {missing[0]}; name a block its forward runs")
    return calls


def is_graph_identity(func: Any, source: torch.Tensor, result: Any) -> bool:
    """Whether ``func`` made ``result`` from ``source`` with no node in the exported graph: a copy or a no-op
    conversion (SD3's ``pos_embed(x).contiguous()`` is, in the graph, pos_embed's own output)."""
    import torch

    return (
        getattr(func, "__name__", "") in GRAPH_IDENTITIES
        and isinstance(result, torch.Tensor)
        and (result.shape, result.dtype) == (source.shape, source.dtype)
    )


def tensor_leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """The tensors in nested tuples, lists and dicts, with their paths."""
    import torch

    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, (tuple, list)):
        return [leaf for i, v in enumerate(value) for leaf in tensor_leaves(v, (*path, i))]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in tensor_leaves(v, (*path, k))]
    return []


def replace_leaves(value: Any, new: dict[tuple[Any, ...], Any], path: tuple[Any, ...] = ()) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return new[path]
    if isinstance(value, (tuple, list)):
        return type(value)(replace_leaves(v, new, (*path, i)) for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: replace_leaves(v, new, (*path, k)) for k, v in value.items()}
    return value


def stored_names(network: Any, params: dict[str, StoredTensor]) -> dict[str, str]:
    """Each parameter's name → the name the checkpoint stores it under: its own, or for a weight tied to another
    (one tensor under two names, T5's encoder.embed_tokens.weight and shared.weight) the one saved."""
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in network.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    out = {name: name for name in params}
    for tied in names.values():
        if saved := next((n for n in tied if n in params), None):
            out |= {n: saved for n in tied if n not in params}
    return out


def load_block(network: Any, block: str, params: dict[str, StoredTensor]) -> Any:
    """A copy of the meta network's ``block`` made real in fp32 on the CPU, its tensors read by prefix from the
    shards (the meta network is left as it was, its tied weights tied)."""
    import torch
    from safetensors import safe_open

    module = copy.deepcopy(network.get_submodule(block)).to_empty(device="cpu")
    prefix = block + "."
    by_shard: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for name, saved in stored_names(network, params).items():
        if name.startswith(prefix):
            by_shard[params[saved].shard].append((name, saved))
    stored = {name[len(prefix) :] for names in by_shard.values() for name, _ in names}
    unset = [n for n, _ in module.named_buffers() if n not in stored]
    if unset:
        init_weights = getattr(network, "_init_weights", None)
        if init_weights is None:
            raise ArtifactError(
                f"{block} has buffers the checkpoint does not store ({unset[0]}); it cannot be loaded alone"
            )
        # transformers builds on the meta device and sets the buffers no checkpoint stores (CLIP's position_ids) in
        # _init_weights, as its from_pretrained does (transformers/initialization.py: copy_ into buffers). Only
        # their modules, before loading: _init_weights also draws the weights that loading then replaces.
        for owner in dict.fromkeys(n.rpartition(".")[0] for n in unset):
            init_weights(module.get_submodule(owner))
    state: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        with safe_open(str(shard), framework="pt") as f:
            state |= {name[len(prefix) :]: f.get_tensor(params[saved].key).to(torch.float32) for name, saved in names}
    module.load_state_dict(state, strict=True)  # every parameter and persistent buffer, or a clear error
    return module.float().eval()
