"""The model's parameters, from the safetensors headers: each stored tensor's shard, dtype and shape, nothing loaded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...core.errors import ArtifactError

SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    shard: Path
    dtype: str  # numpy-style name
    shape: tuple[int, ...]
    key: str  # its name in the shard

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: 8 bytes of little-endian length, then JSON; the tensors are not read."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return dict(json.loads(f.read(length)))


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model folder's safetensors files (sharded with an index, or one file), by state-dict name."""
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ArtifactError(f"{folder} has no .safetensors weights; save the model with safe_serialization=True")
    out = {}
    for shard in shards:
        for name, entry in safetensors_header(shard).items():
            if name != "__metadata__":
                out[name] = StoredTensor(shard, SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"]),
                                         tuple(entry["shape"]), name)  # fmt: skip
    return out


def loaded_tensors(network: Any, folder: Path) -> dict[str, StoredTensor]:
    """``stored_tensors`` by the names ``from_pretrained`` gives them in ``network`` (built from the folder's config):
    transformers' checkpoint renamings, as the streamed export applies them (Qwen2.5-VL saves its language model's
    ``model.language_model.layers.*`` as ``model.layers.*``)."""
    from ...stages.export_stream import renamed_as_loaded

    stored = stored_tensors(folder)
    return renamed_as_loaded(network, stored, folder) if hasattr(network, "base_model_prefix") else stored
