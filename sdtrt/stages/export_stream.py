"""The weight-free export (``weights="stream"``): the network built from its config with no weight data, traced by
torch.export on fake CPU tensors, its initializers streamed from the model's safetensors files into the graph."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ExportError
from ..core.progress import quiet_loading
from ..graph import onnx_graph, onnx_weights
from ..graph.onnx_scopes import WRAPPER
from ..graph.onnx_stamp import STAMP_FROM, stamp_blocks
from ..sources.models import ModelSource
from ..spec import GraphSpec

if TYPE_CHECKING:
    import torch

# A graph that holds its weights is serialized whole in memory (SD 1.5's fp16 UNet, 1.7 GB inline: 8.3 GiB peak):
# a streamed graph keeps weights over this in ``.onnx.data``, the same initializers, only stored beside the graph.
INLINE_UP_TO = 64 * 2**20


def weight_free_network(
    model: ModelSource, folder: str, dtype: torch.dtype, overrides: dict[str, int] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The folder's network built from its config (with ``overrides``: fewer blocks, stamped_blocks) with no weight
    data (every tensor on the meta device), in the dtypes ``from_pretrained(dtype=…)`` gives it; and
    ``attach_weights``' arguments: its safetensors tensors, and the values of its non-persistent buffers (computed at
    construction, never in the safetensors files: CLIP's position ids), by graph initializer name. Raise ExportError
    if the files lack a weight it needs."""
    import importlib

    import torch
    from accelerate import init_empty_weights

    library, class_name = model.component_class(folder)
    cls = (
        getattr(importlib.import_module(library), class_name, None)
        if library in ("diffusers", "transformers")
        else None
    )
    if cls is None:
        raise ExportError(
            f"{folder}/ of '{model.name}' is a {class_name or 'class without a name'}, which sdtrt cannot build"
        )
    path = model.component_dir(folder)
    # accelerate: parameters on the meta device, buffers computed for real (the non-persistent ones need that).
    with quiet_loading(), init_empty_weights(include_buffers=False):
        if library == "transformers":
            network = cls._from_config(cls.config_class.from_pretrained(path, **(overrides or {})))
        else:
            network = cls.from_config({**cls.load_config(path), **(overrides or {})})
        network.to(dtype)
    if tie := getattr(network, "tie_weights", None):  # transformers ties inside init_empty_weights to copies
        tie()
    for name, module in network.named_modules():
        if set(name.split(".")) & keep_fp32_modules(network, dtype):
            module.float()
    network.eval()
    computed: dict[str, Any] = {}
    for prefix, module in network.named_modules():
        for name in module._non_persistent_buffers_set:
            buffer = getattr(module, name)
            if buffer is not None:  # numpy has no bfloat16: widen, the graph's dtype is restored when written
                value = buffer.float() if buffer.dtype == torch.bfloat16 else buffer
                computed[f"network.{prefix}{'.' if prefix else ''}{name}"] = value.numpy()
    stored = onnx_weights.safetensors_index(path)
    if library == "transformers":
        stored = renamed_as_loaded(network, stored, path)
    elif rename := getattr(network, "_fix_state_dict_keys_on_load", None):  # diffusers' own renaming, as on load:
        rename(stored)  # a VAE's attention keys saved under their old names (query → to_q …: SD 2.1-base's)
    # Tied weights are saved once (T5's shared / encoder.embed_tokens): each name reads the one saved.
    tied: dict[int, list[str]] = {}
    for name, tensor in network.state_dict(keep_vars=True).items():
        tied.setdefault(id(tensor), []).append(name)
    for names in tied.values():
        if saved := next((stored[name] for name in names if name in stored), None):
            stored |= dict.fromkeys(names, saved)
    onnx_weights.check_sources(network.state_dict().keys(), stored, path)
    return network.to("meta"), {"sources": stored, "computed": computed, "prefix": WRAPPER}


def stamped_blocks(spec: GraphSpec, config: dict[str, Any]) -> dict[str, int]:
    """The spec's repeated block lists that the network's config makes longer than STAMP_FROM, by module path in the
    traced graph (the network is graph_module's ``network``), with their full length."""
    counts = {WRAPPER + blocks: int(config.get(key, 0)) for blocks, key in spec.stampable_blocks.items()}
    return {path: count for path, count in counts.items() if count > STAMP_FROM}


def stamping(blocks: dict[str, int]) -> dict[str, Any]:
    """How a graph's blocks were stamped, for its key and manifest: the copies traced per list (STAMP_FROM: the
    stamped values' names follow from it) and each list's full count; {} for a graph traced whole."""
    return {"traced_copies": STAMP_FROM, "blocks": blocks} if blocks else {}


def stamped_reason(spec: GraphSpec, weights: str, blocks: dict[str, int]) -> str:
    """Why a graph's blocks were stamped (``blocks``, stamped_blocks') or traced whole, for its manifest."""
    if blocks:
        lists = ", ".join(path.removeprefix(WRAPPER) for path in blocks)
        return f"streamed: {STAMP_FROM} copies of {lists} traced, the others stamped (shorter lists whole)"
    if weights != "stream":
        return "traced whole: only a streamed export (--weights stream) stamps blocks"
    if spec.stamping_problem:
        return f"traced whole: {spec.stamping_problem}"
    if not spec.repeated_blocks:
        return f"traced whole: the {spec.label} lists no repeated blocks to stamp"
    return f"traced whole: no block list is longer than the {STAMP_FROM} copies a stamped trace traces"


def stamp_overrides(spec: GraphSpec, blocks: dict[str, int]) -> dict[str, int]:
    """The config keys that build the network with STAMP_FROM copies of each list in ``blocks``."""
    return {key: STAMP_FROM for path, key in spec.repeated_blocks.items() if WRAPPER + path in blocks}


def renamed_as_loaded(network: Any, stored: dict[str, Any], path: Path) -> dict[str, Any]:
    """The stored tensors under the names ``from_pretrained`` gives them: transformers' own checkpoint conversion
    mapping for the network's class (Qwen2.5-VL's saved ``visual.*`` / ``model.layers.*`` are its
    ``model.visual.*`` / ``model.language_model.layers.*``), renamed as its loader renames them. ExportError for a
    tensor the loader converts (merges or splits), which a stream of stored tensors cannot give."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(network)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    wanted = network.state_dict()
    renamed = {}
    for key, tensor in stored.items():
        name, converted = rename_source_key(key, renamings, converters, network.base_model_prefix, wanted)
        if name not in wanted and key in wanted:  # as the loader: the saved name itself, where that one fits
            name, converted = key, None
        if converted is not None and name in wanted:
            raise ExportError(
                f"{path}: transformers converts tensor '{key}' on load (not a renaming), which a streamed export "
                "cannot give: export with --weights load"
            )
        renamed[name] = tensor
    return renamed


def keep_fp32_modules(network: Any, dtype: torch.dtype) -> set[str]:
    """The module names transformers keeps fp32 when loading in ``dtype`` (``PreTrainedModel._get_dtype_plan``:
    ``_keep_in_fp32_modules`` for fp16, ``_keep_in_fp32_modules_strict`` for fp16 and bf16; T5's ``wo``)."""
    import torch

    keep = set(getattr(network, "_keep_in_fp32_modules_strict", None) or ()) if dtype != torch.float32 else set()
    if dtype == torch.float16:
        keep |= set(getattr(network, "_keep_in_fp32_modules", None) or ())
    return keep


def on_fake_cpu(module: torch.nn.Module) -> Any:
    """Replace the module's meta-device parameters and buffers by fake CPU tensors, which hold no data either;
    the FakeTensorMode they belong to, for the example inputs.

    Not traced on the meta device itself: operators dispatch by device, and on "meta" some take another path
    (scaled_dot_product_attention's decomposition reshapes differently), so the graph would not be the CPU one.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # As torch.onnx.enable_fake_mode did before torch 2.13 removed it: one mode, with a shape environment.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes: dict[int, torch.nn.Parameter] = {}  # by the meta parameter: tied weights (T5's embeddings) stay tied
    with fake_mode:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None:
                    if id(param) not in fakes:
                        fakes[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="cpu"), False)
                    owner._parameters[name] = fakes[id(param)]
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None:
                    owner._buffers[name] = torch.empty_like(buffer, device="cpu")
    return fake_mode


def _save_streamed(program: Any, spec: GraphSpec, onnx_path: Path, scratch: Path) -> int:
    """Save the program with its initializers streamed to disk one at a time, axes named; the node count."""
    import onnx

    weight_bytes = sum(value.const_value.nbytes for value in program.model.graph.initializers.values())
    external = weight_bytes > min(onnx_graph.EXTERNAL_DATA_THRESHOLD, INLINE_UP_TO)
    onnx_weights.save_streamed(program.model, onnx_path, external, scratch)
    proto = onnx_graph.load_graph(onnx_path)  # the graph alone: its external weights stay on disk
    onnx_graph.name_dynamic_axes(proto, spec)
    onnx.save_model(proto, str(onnx_path))  # the initializers' external data references as they are
    return len(proto.graph.node)


@contextlib.contextmanager
def before_optimize(hook: Callable[[Any], None]) -> Iterator[None]:
    """Call ``hook(onnx_ir_model)`` inside torch.onnx.export(dynamo=True) just before it optimizes the model.

    torch 2.13's exporter (torch/onnx/_internal/exporter/_core.py ``export``) converts the opset, then calls
    ``onnx_program.optimize()``, then renames inputs, outputs and axes: hooking there keeps that order. Not for
    threads: the hook is the class's while inside (sdtrt exports one graph at a time, in its calling thread).
    """
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    original = ONNXProgram.optimize

    def optimize(self: Any) -> None:
        hook(self.model)
        original(self)

    ONNXProgram.optimize = optimize  # type: ignore[method-assign]
    try:
        yield
    finally:
        ONNXProgram.optimize = original  # type: ignore[method-assign]


def graph_hook(sources: dict[str, Any], blocks: dict[str, int]) -> Callable[[Any], None]:
    """What before_optimize runs on the weight-free trace: its repeated blocks stamped to their full count (while the
    graph holds no data), then its initializers attached by name: the optimizer sees the full network's graph."""

    def hook(model: Any) -> None:
        stamp_blocks(model, blocks)
        onnx_weights.attach_weights(model, **sources)

    return hook
