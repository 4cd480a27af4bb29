"""Reading weight maps and graph weights: the records the weight-map stage writes, for LoRA and the runtimes.

The stage (sdtrt.stages.weight_map) builds a map from a graph and its PyTorch network; LoRA
(sdtrt.lora.refit) and the runtimes that take new weights (ONNX Runtime, a TensorRT refit) only read maps
and the base weights the map names. Those readers live here, below all three, so neither a runtime
nor LoRA reaches up into a stage.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ArtifactError
from . import onnx_graph

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Placement:
    initializer: str
    transpose: bool  # the initializer holds the parameter transposed (a Linear weight as MatMul's B)
    shape: tuple[int, ...]  # the parameter's shape in PyTorch
    # Columns [start, stop) of a packed initializer that hold the (transposed) parameter: onnxsim's
    # fuse_qkv pass packs q/k/v projections that share an input into one MatMul (CLIP's attention).
    columns: tuple[int, int] | None = None


@dataclass(frozen=True)
class WeightMap:
    graph: Path  # the ONNX graph whose initializers it names
    graph_dtype: str
    mapped: dict[str, Placement]
    unmapped: dict[str, str]  # parameter → why it could not be placed
    # parameters no output reads (GraphSpec.unread_parameters) → their shapes: no engine holds them, a LoRA of their
    # shape changes nothing there
    unread: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, graph: Path, data: dict[str, Any]) -> WeightMap:
        mapped = {
            k: Placement(
                v["initializer"], v["transpose"], tuple(v["shape"]), tuple(v["columns"]) if v["columns"] else None
            )
            for k, v in data["mapped"].items()
        }
        unread = {k: tuple(v) for k, v in data["unread"].items()}
        return cls(graph, data["graph_dtype"], mapped, dict(data["unmapped"]), unread)

    def to_json(self) -> dict[str, Any]:
        mapped = {
            k: {"initializer": p.initializer, "transpose": p.transpose, "shape": list(p.shape),
                "columns": list(p.columns) if p.columns else None}
            for k, p in self.mapped.items()
        }  # fmt: skip
        unread = {k: list(v) for k, v in sorted(self.unread.items())}
        return {"graph_dtype": self.graph_dtype, "mapped": mapped, "unmapped": self.unmapped, "unread": unread}


def initializer_values(graph_path: Path, names: set[str] | None = None, min_rank: int = 0) -> Iterator[tuple[str, Any]]:
    """(name, value) of the graph's initializers (those in ``names``, of at least ``min_rank`` dims), one at a time.

    External data is memory-mapped at its declared offset, read-only: nothing is read until the value is used, and
    the page cache, not the process, holds what was. The graph itself is loaded without its weights.
    """
    base_dir = graph_path.parent.resolve()
    for tensor in onnx_graph.load_graph(graph_path).graph.initializer:
        if (names is None or tensor.name in names) and len(tensor.dims) >= min_rank:
            yield tensor.name, tensor_value(tensor, base_dir)


def tensor_value(tensor: Any, base_dir: Path) -> np.ndarray:
    """An initializer's value: inline data converted, external data mapped from its file (never read whole)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    from .onnx_weights import numpy_dtype

    # onnx < 1.19 maps BFLOAT16 to float32 (onnx/mapping.py v1.17.0:49-51) and its to_array widens bf16 to float32
    # (1.17) or returns a uint16-named view (1.18): bf16 is read as ml_dtypes.bfloat16 here, whatever the onnx.
    bf16 = tensor.data_type == TensorProto.BFLOAT16
    if not uses_external_data(tensor):
        return _inline_bf16(tensor) if bf16 else numpy_helper.to_array(tensor)
    info = ExternalDataInfo(tensor)
    path = (base_dir / info.location).resolve()
    if base_dir not in path.parents:
        raise ArtifactError(f"initializer {tensor.name} points outside its graph's folder ({info.location}); re-export")
    dtype = numpy_dtype("bfloat16") if bf16 else helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    if math.prod(shape) == 0:  # an empty tensor: nothing to map
        return np.zeros(shape, dtype)
    # A view, not the np.memmap subclass, so arithmetic on it gives plain arrays.
    return np.memmap(path, dtype=dtype, mode="r", offset=info.offset or 0, shape=shape).view(np.ndarray)


def _inline_bf16(tensor: Any) -> np.ndarray:
    """An inline bf16 tensor: raw little-endian bytes, or (onnx.proto) each value's 16 bits in an int32_data entry."""
    import numpy as np

    from .onnx_weights import numpy_dtype

    dtype, shape = numpy_dtype("bfloat16"), tuple(tensor.dims)
    if tensor.HasField("raw_data"):
        return np.frombuffer(tensor.raw_data, dtype="<u2").reshape(shape).view(dtype)
    return np.asarray(tensor.int32_data, dtype=np.uint32).astype(np.uint16).reshape(shape).view(dtype)


def as_torch(array: np.ndarray) -> Any:
    """A torch tensor sharing ``array``'s memory; bf16 (ml_dtypes') through its 16 bits, which torch.from_numpy
    refuses as a type it does not know."""
    import numpy as np
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def as_numpy(tensor: Any) -> np.ndarray:
    """A CPU tensor as numpy, sharing its memory; bf16 as ml_dtypes' bfloat16 (Tensor.numpy refuses bf16)."""
    import torch

    from .onnx_weights import numpy_dtype

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.uint16).numpy().view(numpy_dtype("bfloat16"))
    return tensor.numpy()


def read_named_initializers(graph_path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The values of those named initializers the graph has, mapped from its external data (see initializer_values)."""
    return dict(initializer_values(graph_path, names))


def read_initializers(graph_path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The named initializers' values (the engine's base weights), read from the graph."""
    out = read_named_initializers(graph_path, names)
    if missing := sorted(names - set(out)):
        raise ArtifactError(f"{graph_path} has no initializer '{missing[0]}'; its weight map is stale, rebuild it")
    return out
