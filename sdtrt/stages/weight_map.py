"""Weight-map stage: which graph initializer holds each network weight a LoRA can touch, and how.

Export and simplify rename and transform weights: a ``Linear`` weight ``[out, in]`` becomes an
anonymous, transposed MatMul initializer ``[in, out]``, in the graph's dtype (fp16: a cast), and
constant folding makes new initializers. Names are no guide, so the map is derived from values:
every Linear and Conv weight of the graph's network (the UNet, SD3's or Flux's transformer, a text
encoder), in the graph's dtype exactly as export loads it, is looked up among the graph's
initializers by content hash, as it is, transposed, or packed side by side with others in a wider
initializer's columns (onnxsim's fuse_qkv pass packs CLIP's q/k/v projections into one MatMul; SD3's and
Flux's q/k/v and add_q/k/v projections reach the engine graph packed too).
A parameter found nowhere (folded into something else), found twice (ambiguous), or sharing its
initializer with another parameter (deduplicated constants) is listed as unmapped with the
reason, and a LoRA touching it is refused by name (sdtrt.lora.refit).

The map is its own small artifact, ``weight-map/<key>/weight_map.json``, not part of the simplify
artifact: it reads every weight of the graph and of the network, which only engines that take LoRAs should pay
for, and it maps the graph the engine actually runs — ONNX Runtime's optimized graph
for ``build-ort`` (its optimizer could rename or fuse initializers), the simplified graph a
TensorRT plan was parsed from (the ONNX parser names refittable weights after initializers). Its
key follows from that graph's key and the digest of the network's model folder: made once per graph,
on the first LoRA, a cache hit after.

weight_map.json: ``{"graph_dtype": "float16", "mapped": {param: {"initializer", "transpose", "shape"}},
"unmapped": {param: reason}}``; a param is the network's state-dict name (``….attn1.to_q.weight``; for
CLIP without the ``text_model.`` prefix that older transformers versions have).

Size does not matter: the graph's initializers are memory-mapped from its external data and hashed one at a
time, and the network is built on the meta device with each weight read alone from its safetensors shards, so
the map holds one tensor of each (and a hash per initializer), not the model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ..core.artifact import Artifact
from ..core.errors import LoraError, UnsupportedModelError
from ..core.progress import quiet_loading, step
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..graph import onnx_graph
from ..graph.graph_weights import Placement, WeightMap, as_numpy, as_torch, initializer_values
from ..graph.onnx_weights import WEIGHT_FILES, numpy_dtype, read_tensor, safetensors_file_index, safetensors_index
from ..spec import FOLDERS, component_spec
from .quantize import quantization

if TYPE_CHECKING:
    import numpy as np

    from ..core.config import Component
    from ..sources.models import ModelSource

STAGE = "weight-map"
VERSION = 4  # 2: packed q/k/v initializers (Placement.columns); 3: unread weights (Qwen-Image's last text stream);
# 4: their shapes (a LoRA module of another shape on one is refused)
FILE = "weight_map.json"


@dataclass(frozen=True)
class WeightMapConfig:
    """No settings: the map follows from the graph and the model."""


def for_engine(engine: Artifact, model: ModelSource, component: str = "unet") -> WeightMap:
    """The weight map of the graph ``engine`` (the model's ``component``) runs, from its store (made on first use).

    LoraError for an engine made from a Q/DQ graph: its scales were calibrated on the base weights, which a
    TensorRT plan holds as 8-bit values, so a LoRA is fused first and the result quantized (as NVIDIA's demo does).
    """
    if precision := quantization(engine):
        raise LoraError(
            f"the {component} engine {engine.path} is quantized to {precision.upper()}, and LoRAs cannot change a "
            "quantized engine (its scales were calibrated on the base weights): fuse the LoRA into the model first "
            "and quantize that (diffusers' fuse_lora, then save_pretrained), as NVIDIA's demo requires"
        )
    graph = onnx_graph.graph_of(
        engine,
        f"a '{engine.stage}' engine cannot take new weights (a wrapped TorchScript engine has no refitter); "
        "load its build-trt artifact (built with --refittable) or an ONNX Runtime engine for LoRAs",
    )
    if graph.stage == "external":  # outside any store: nothing to cache in
        return build(graph.primary, model, component)
    store = Store(graph.path.parents[1])
    request = StageRequest(
        STAGE,
        VERSION,
        WeightMapConfig(),
        [graph.as_input(), {"kind": "model", "digest": model.folder_digest(FOLDERS[component]), **model.describe()}],
        environment("diffusers"),
    )
    artifact, _ = store.produce(request, lambda out_dir: _produce(graph, model, component, out_dir))
    return WeightMap.from_json(graph.primary, json.loads((artifact.path / FILE).read_text()))


def _produce(graph: Artifact, model: ModelSource, component: str, out_dir: Path) -> dict[str, Any]:
    started = time.perf_counter()
    weight_map = build(graph.primary, model, component)
    (out_dir / FILE).write_text(json.dumps(weight_map.to_json(), indent=1))
    return {
        "primary": FILE,
        "timings": {"map_s": round(time.perf_counter() - started, 3)},
        "details": {
            "graph": str(graph.primary),
            "mapped": len(weight_map.mapped),
            "unmapped": len(weight_map.unmapped),
            "unread": len(weight_map.unread),
        },
        "reproduce": f"sdtrt lora inspect LORA.safetensors --engine {graph.path}",
    }


def lora_parameters(network: Any) -> dict[str, Any]:
    """The weights a LoRA can touch: every Linear and Conv2d weight, by state-dict name (CLIP's without
    ``text_model.``, as sdtrt.lora.files.peft_names names LoRA modules)."""
    return {param: module.weight.detach() for param, _, module in _lora_modules(network)}


def _lora_modules(network: Any) -> Iterator[tuple[str, str, Any]]:
    """(param, module name, module) of every Linear and Conv2d: ``param`` as the map names it."""
    import torch

    for name, module in network.named_modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Conv2d):
            yield f"{name.removeprefix('text_model.')}.weight", name, module


def network_weights(model: ModelSource, component: str, dtype: Any) -> Iterator[tuple[str, Any]]:
    """lora_parameters of the ``component`` network in ``dtype``, one tensor at a time, without loading the network.

    The network is built on the meta device (names and module types, no weights); each weight is read alone from
    the folder's safetensors and cast as from_pretrained casts it (modules the class keeps in fp32 stay fp32 in fp16).
    Each read maps only its own bytes and lets them go: a handle open on a whole shard would keep every page it
    touched in the process (a 23.8 GB Flux transformer's map passed 10 GB that way).
    """
    import torch

    folder = FOLDERS[component]
    network = _meta_network(model, folder)
    keep_fp32 = set(getattr(network, "_keep_in_fp32_modules", None) or ()) if dtype == torch.float16 else set()
    files = _safetensors_files(model.component_dir(folder), model.name)
    headers = functools.cache(safetensors_file_index)
    modules = list(_lora_modules(network))
    spec = component_spec(model, cast("Component", component))
    unread = spec.unread_parameters(model.component_config(folder), [param for param, _, _ in modules])
    for param, name, module in modules:
        if param in unread:
            yield param, Unread(tuple(module.weight.shape))  # a meta tensor: its shape, no bytes
            continue
        file = files.get(f"{name}.weight")
        if file is None:
            yield param, None  # tied to or derived from another weight: nothing stored to match
            continue
        wanted = torch.float32 if keep_fp32 & set(name.split(".")) else dtype
        stored = headers(file)[f"{name}.weight"]
        yield param, as_torch(read_tensor(stored, numpy_dtype(str(wanted).removeprefix("torch."))))


def _meta_network(model: ModelSource, folder: str) -> Any:
    """The folder's network on the meta device: its module tree from its config, no weight memory."""
    import importlib

    import torch

    library, class_name = ("diffusers", "UNet2DConditionModel") if folder == "unet" else model.component_class(folder)
    cls = (
        getattr(importlib.import_module(library), class_name, None)
        if library in ("diffusers", "transformers")
        else None
    )
    if cls is None:
        raise UnsupportedModelError(f"{folder}/ of '{model.name}' is a {class_name or 'class without a name'}")
    directory = model.component_dir(folder)
    with quiet_loading(), torch.device("meta"):
        if library == "diffusers":
            return cls.from_config(cls.load_config(directory))
        return cls._from_config(cls.config_class.from_pretrained(directory))


def _safetensors_files(directory: Path, model_name: str) -> dict[str, Path]:
    """Each stored tensor's file, from the weight files' headers."""
    if files := {name: stored.file for name, stored in safetensors_index(directory).items()}:
        return files
    raise UnsupportedModelError(
        f"{directory} of '{model_name}' has no {' or '.join(WEIGHT_FILES)} (with or without a shard index): the weight "
        "map reads weights one at a time from safetensors; re-save the model with save_pretrained"
    )


def _content_key(array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
    import numpy as np

    data = np.ascontiguousarray(array)
    return data.dtype.str, data.shape, hashlib.blake2b(data.view(np.uint8).data, digest_size=16).hexdigest()


@dataclass(frozen=True)
class Unread:
    """network_weights' value for a weight no output reads: its shape, which a LoRA module on it must have."""

    shape: tuple[int, ...]


GraphWeights = Callable[[], Iterable[tuple[str, "np.ndarray"]]]
NetworkWeights = Callable[[Any], Iterable[tuple[str, Any]]]


def build(graph_path: Path, model: ModelSource, component: str = "unet") -> WeightMap:
    """Match the ``component`` network's LoRA-touchable weights against ``graph_path``'s initializers by value,
    holding one tensor of each at a time (the graph's are memory-mapped, the network's read from safetensors)."""
    with step(f"Mapping {component} weights onto the initializers of {graph_path.name}"):
        return match(
            graph_path,
            lambda: initializer_values(graph_path, min_rank=2),  # biases, scalars and shapes are never LoRA targets
            lambda dtype: network_weights(model, component, dtype),
        )


def match(graph_path: Path, graph_weights: GraphWeights, network: NetworkWeights) -> WeightMap:
    """The weight map from the graph's 2-D+ initializers and the network's weights (in the dtype it is given),
    each an iterable read once (the graph's twice, when some Linear weight is only found packed)."""
    import torch

    by_content: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
    dtypes = set()
    for name, array in graph_weights():
        dtypes.add(array.dtype.name)
        by_content.setdefault(_content_key(array), []).append(name)
    # A 16-bit graph's weights are matched in its dtype, exactly as export cast them; bf16 (ml_dtypes' in the graph,
    # torch's in the network) is compared by its bits on both sides (as_numpy).
    graph_dtype = next((d for d in ("bfloat16", "float16") if d in dtypes), "float32")
    shapes: dict[str, tuple[int, ...]] = {}
    found: dict[str, list[tuple[str, bool]]] = {}
    unplaced: dict[str, tuple[str, tuple[int, ...], str]] = {}  # Linear weights found nowhere: their transpose's key
    absent: dict[str, str] = {}
    unread = {}
    for param, weight in network(getattr(torch, graph_dtype)):
        if isinstance(weight, Unread):
            unread[param] = weight.shape
            continue
        if weight is None:
            absent[param] = "the model's weight files do not hold it (tied to or derived from another weight)"
            continue
        shapes[param] = tuple(weight.shape)
        candidates = [(weight, False)] + ([(weight.T, True)] if weight.ndim == 2 else [])
        found[param] = [
            (name, transposed)
            for tensor, transposed in candidates
            for name in by_content.get(_content_key(as_numpy(tensor.contiguous())), [])
        ]
        if not found[param] and weight.ndim == 2:
            unplaced[param] = _content_key(as_numpy(weight.T.contiguous()))
    holders: dict[str, list[str]] = {}
    for param, hits in found.items():
        for name, _ in hits:
            holders.setdefault(name, []).append(param)
    packed = _packed(graph_weights, unplaced, shapes, set(holders)) if unplaced else {}
    mapped, unmapped = {}, dict(absent)
    for param, hits in found.items():
        if param in packed:
            mapped[param] = packed[param]
        elif not hits:
            unmapped[param] = "no initializer holds its value (folded into another constant?)"
        elif len(hits) > 1:
            unmapped[param] = f"its value is in {len(hits)} initializers ({', '.join(n for n, _ in hits[:3])})"
        elif len(holders[hits[0][0]]) > 1:
            others = [p for p in holders[hits[0][0]] if p != param]
            unmapped[param] = f"initializer {hits[0][0]} also holds {others[0]} (identical values, deduplicated)"
        else:
            mapped[param] = Placement(hits[0][0], hits[0][1], shapes[param])
    return WeightMap(graph_path, graph_dtype, mapped, unmapped, unread)


def _packed(
    graph_weights: GraphWeights,
    unplaced: dict[str, tuple[str, tuple[int, ...], str]],
    shapes: dict[str, tuple[int, ...]],
    taken: set[str],
) -> dict[str, Placement]:
    """Linear weights found side by side, transposed, in the columns of a wider 2-D initializer.

    Each free initializer [in, N] is read left to right: at each column, a block as wide as one of
    the unplaced weights with that ``in`` must equal exactly one of them, or the walk stops there.
    """
    by_block: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
    for param, key in unplaced.items():
        by_block.setdefault(key, []).append(param)
    widths: dict[int, set[int]] = {}  # in → the widths (out) of unplaced weights that take it
    for param in unplaced:
        widths.setdefault(shapes[param][1], set()).add(shapes[param][0])
    out: dict[str, Placement] = {}
    for name, array in graph_weights():
        if array.ndim != 2 or name in taken or array.shape[0] not in widths:
            continue
        start = 0
        while start < array.shape[1]:
            hits = [(w, by_block.get(_content_key(array[:, start : start + w]), [])) for w in widths[array.shape[0]]]
            match = next(((w, params[0]) for w, params in hits if len(params) == 1 and params[0] not in out), None)
            if match is None:
                break
            width, param = match
            out[param] = Placement(name, True, shapes[param], (start, start + width))
            start += width
    return out
