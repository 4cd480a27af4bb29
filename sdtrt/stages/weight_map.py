"""Weight-map stage: which graph initializer holds each network weight a LoRA can touch, and how.

Export and simplify rename and transform weights: a ``Linear`` weight ``[out, in]`` becomes an
anonymous, transposed MatMul initializer ``[in, out]``, in the graph's dtype (fp16: a cast), and
constant folding makes new initializers. Names are no guide, so the map is derived from values:
every Linear and Conv weight of the graph's network (the UNet, SD3's or Flux's transformer, a text
encoder), loaded in the graph's dtype exactly as export loads it, is looked up among the graph's
initializers by content hash, as it is, transposed, or packed side by side with others in a wider
initializer's columns (onnxsim's fuse_qkv pass packs CLIP's q/k/v projections into one MatMul; SD3's and
Flux's q/k/v and add_q/k/v projections reach the engine graph packed too).
A parameter found nowhere (folded into something else), found twice (ambiguous), or sharing its
initializer with another parameter (deduplicated constants) is listed as unmapped with the
reason, and a LoRA touching it is refused by name (sdtrt.lora).

The map is its own small artifact, ``weight-map/<key>/weight_map.json``, not part of the simplify
artifact: it needs the PyTorch network (3.4 GB fp32 for SD 1.5's UNet), which only engines that take LoRAs
should pay for, and it maps the graph the engine actually runs — ONNX Runtime's optimized graph
for ``build-ort`` (its optimizer could rename or fuse initializers), the simplified graph a
TensorRT plan was parsed from (the ONNX parser names refittable weights after initializers). Its
key follows from that graph's key and the digest of the network's model folder: made once per graph,
on the first LoRA, a cache hit after.

weight_map.json: ``{"graph_dtype": "float16", "mapped": {param: {"initializer", "transpose", "shape"}},
"unmapped": {param: reason}}``; a param is the network's state-dict name (``….attn1.to_q.weight``; for
CLIP without the ``text_model.`` prefix that older transformers versions have).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import onnx_graph
from ..errors import LoraError
from ..graph_weights import Placement, WeightMap
from ..progress import step
from ..spec import FOLDERS
from ..store import Artifact, StageRequest, Store, environment
from .quantize import quantization

if TYPE_CHECKING:
    import numpy as np

    from ..models import ModelSource

STAGE = "weight-map"
VERSION = 2  # 2: packed q/k/v initializers (Placement.columns)
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
        },
        "reproduce": f"sdtrt lora inspect LORA.safetensors --engine {graph.path}",
    }


def lora_parameters(network: Any) -> dict[str, Any]:
    """The weights a LoRA can touch: every Linear and Conv2d weight, by state-dict name (CLIP's without
    ``text_model.``, as sdtrt.lora_files.peft_names names LoRA modules)."""
    import torch

    return {
        f"{name.removeprefix('text_model.')}.weight": module.weight.detach()
        for name, module in network.named_modules()
        if isinstance(module, torch.nn.Linear | torch.nn.Conv2d)
    }


def _content_key(array: np.ndarray) -> tuple[str, tuple[int, ...], str]:
    import numpy as np

    data = np.ascontiguousarray(array)
    return data.dtype.str, data.shape, hashlib.blake2b(data.view(np.uint8).data, digest_size=16).hexdigest()


def build(graph_path: Path, model: ModelSource, component: str = "unet") -> WeightMap:
    """Match the ``component`` network's LoRA-touchable weights against ``graph_path``'s initializers by value."""
    import torch
    from onnx import numpy_helper

    from ..models import load_folder

    with step(f"Mapping {component} weights onto the initializers of {graph_path.name}"):
        proto = onnx_graph.load_graph(graph_path, with_weights=True)
        by_content: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
        dtypes = set()
        for init in proto.graph.initializer:
            if len(init.dims) >= 2:  # weights; biases, scalars and shape constants are never LoRA targets
                array = numpy_helper.to_array(init)
                dtypes.add(array.dtype.name)
                by_content.setdefault(_content_key(array), []).append(init.name)
        del proto
        graph_dtype = "float16" if "float16" in dtypes else "float32"
        network = load_folder(model, FOLDERS[component], torch.float16 if graph_dtype == "float16" else torch.float32)
        params = lora_parameters(network)
        found: dict[str, list[tuple[str, bool]]] = {}
        for param, weight in params.items():
            candidates = [(weight, False)] + ([(weight.T, True)] if weight.ndim == 2 else [])
            found[param] = [
                (name, transposed)
                for tensor, transposed in candidates
                for name in by_content.get(_content_key(tensor.contiguous().numpy()), [])
            ]
    holders: dict[str, list[str]] = {}
    for param, hits in found.items():
        for name, _ in hits:
            holders.setdefault(name, []).append(param)
    unplaced = {p: params[p] for p, hits in found.items() if not hits and params[p].ndim == 2}
    packed = _packed(graph_path, unplaced, set(holders)) if unplaced else {}
    mapped, unmapped = {}, {}
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
            mapped[param] = Placement(hits[0][0], hits[0][1], tuple(params[param].shape))
    return WeightMap(graph_path, graph_dtype, mapped, unmapped)


def _packed(graph_path: Path, unplaced: dict[str, Any], taken: set[str]) -> dict[str, Placement]:
    """Linear weights found side by side, transposed, in the columns of a wider 2-D initializer.

    Each free initializer [in, N] is read left to right: at each column, a block as wide as one of
    the unplaced weights with that ``in`` must equal exactly one of them, or the walk stops there.
    """
    from onnx import numpy_helper

    by_block: dict[tuple[str, tuple[int, ...], str], list[str]] = {}
    for param, weight in unplaced.items():
        by_block.setdefault(_content_key(weight.T.contiguous().numpy()), []).append(param)
    widths: dict[int, set[int]] = {}  # in → the widths (out) of unplaced weights that take it
    for weight in unplaced.values():
        widths.setdefault(int(weight.shape[1]), set()).add(int(weight.shape[0]))
    out: dict[str, Placement] = {}
    for init in onnx_graph.load_graph(graph_path, with_weights=True).graph.initializer:
        if len(init.dims) != 2 or init.name in taken or init.dims[0] not in widths:
            continue
        array, start = numpy_helper.to_array(init), 0
        while start < array.shape[1]:
            hits = [(w, by_block.get(_content_key(array[:, start : start + w]), [])) for w in widths[init.dims[0]]]
            match = next(((w, params[0]) for w, params in hits if len(params) == 1 and params[0] not in out), None)
            if match is None:
                break
            width, param = match
            out[param] = Placement(init.name, True, tuple(unplaced[param].shape), (start, start + width))
            start += width
    return out
