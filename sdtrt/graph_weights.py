"""Reading weight maps and graph weights: the records the weight-map stage writes, for LoRA and the runtimes.

The stage (sdtrt.stages.weight_map) builds a map from a graph and its PyTorch network; LoRA
(sdtrt.lora) and the runtimes that take new weights (ONNX Runtime, a TensorRT refit) only read maps
and the base weights the map names. Those readers live here, below all three, so neither a runtime
nor LoRA reaches up into a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import onnx_graph
from .errors import ArtifactError

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

    @classmethod
    def from_json(cls, graph: Path, data: dict[str, Any]) -> WeightMap:
        mapped = {
            k: Placement(
                v["initializer"], v["transpose"], tuple(v["shape"]), tuple(v["columns"]) if v["columns"] else None
            )
            for k, v in data["mapped"].items()
        }
        return cls(graph, data["graph_dtype"], mapped, dict(data["unmapped"]))

    def to_json(self) -> dict[str, Any]:
        mapped = {
            k: {"initializer": p.initializer, "transpose": p.transpose, "shape": list(p.shape),
                "columns": list(p.columns) if p.columns else None}
            for k, p in self.mapped.items()
        }  # fmt: skip
        return {"graph_dtype": self.graph_dtype, "mapped": mapped, "unmapped": self.unmapped}


def read_named_initializers(graph_path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The values of those named initializers the graph has, reading only their bytes of its external data."""
    from onnx import numpy_helper

    proto = onnx_graph.load_graph(graph_path, with_weights=False)
    # to_array reads a tensor's external data itself, relative to base_dir. Loading it first breaks with older onnx
    # (1.17 included; pyproject allows >=1.16): its load_external_data_for_tensor leaves the tensor marked external,
    # and to_array then reads it again relative to the working directory (onnx numpy_helper.py, to_array).
    return {
        init.name: numpy_helper.to_array(init, base_dir=str(graph_path.parent))
        for init in proto.graph.initializer
        if init.name in names
    }


def read_initializers(graph_path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The named initializers' values (the engine's base weights), read from the graph."""
    out = read_named_initializers(graph_path, names)
    if missing := sorted(names - set(out)):
        raise ArtifactError(f"{graph_path} has no initializer '{missing[0]}'; its weight map is stale, rebuild it")
    return out
