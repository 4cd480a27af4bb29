"""Random weights written by streaming: a network's checkpoint laid out as ``save_pretrained`` writes it, never
held in memory.

The network is built with its parameters on the meta device (shapes and dtypes, no storage). Each tensor is
then made from a seed derived from its name, written into its shard and dropped, so memory holds one tensor
at a time whatever the model's size. The files are the ones ``save_pretrained(safe_serialization=True,
max_shard_size=…)`` writes for the same network — state-dict keys (tied weights dropped, non-persistent
buffers absent), shapes, dtypes, shard split, index and config — so ``from_pretrained`` reads them as any
checkpoint. Dtypes come from building the network as an eager build would (same default dtype), so whatever
its constructor keeps in fp32 is fp32 here too; transformers applies ``_keep_in_fp32_modules`` when it loads,
not when it saves.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# diffusers' default shard is 10 GB and transformers' 50 GB; both libraries' from_pretrained read a checkpoint
# one whole shard at a time (safetensors' load_file copies it into memory), and so will a loader of single
# blocks, so the shard is what loading costs on top of the model. 2 GB keeps that small on a 24 GB machine
# shared by several processes, and the files stay few (a 24 GB Flux transformer is 13 shards).
SHARD_SIZE = 2_000_000_000

# safetensors' dtype names in the order of its Dtype enum (increasing alignment): its writer sorts tensors by
# this order descending, then by name (huggingface/safetensors safetensors/src/tensor.rs, `Dtype` and `prepare`).
_SAFETENSORS_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                      "F64", "I64", "U64")  # fmt: skip
_SAFETENSORS_NAMES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
                      "int16": "I16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "float32": "F32",
                      "float64": "F64", "int64": "I64"}  # fmt: skip
# Vectors' spread: biases small, norm gains near 1.
VECTOR_STD = 0.02


@contextmanager
def empty_weights() -> Iterator[None]:
    """Networks built inside have their parameters on the meta device: shapes and dtypes, no memory.

    Buffers stay real: the persistent ones hold computed values that save_pretrained writes (SD3's sin-cos
    positional embedding), and they are small beside the weights.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def save_random(model: Any, folder: Path, *, seed: str, max_shard_size: int = SHARD_SIZE, weights: bool = True) -> None:
    """Write ``model``'s config and random weights into ``folder`` as its save_pretrained would.

    ``model`` is a diffusers ModelMixin or a transformers PreTrainedModel built under ``empty_weights()``;
    its meta parameters get random values seeded by ``seed`` and their names, its buffers their own values.
    ``folder`` should be fresh and renamed into place by the caller once everything is written. ``weights``
    False: the config alone.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    layout = _layout(model)
    folder.mkdir(parents=True, exist_ok=True)
    layout.save_config(model, folder)
    if not weights:
        return
    state = layout.state_dict(model)
    split = split_torch_state_dict_into_shards(state, filename_pattern=layout.pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        write_safetensors(folder / filename, {name: state[name] for name in names}, seed)
    if split.is_sharded:
        index = {"metadata": layout.index_metadata(model) | split.metadata, "weight_map": split.tensor_to_filename}
        (folder / layout.index).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def random_tensor(key: str, like: torch.Tensor) -> torch.Tensor:
    """Values for a tensor shaped and typed as ``like``, the same for the same ``key`` on every machine.

    Scaled so activations keep their size through deep stacks: matrices and kernels normal / √fan-in (a
    3072-wide layer gets ≈ 0.02, the usual initializer range), norm gains (1-D weights) 1 ± 0.02, biases and
    other vectors ± 0.02. Drawn in fp32, then cast, so precisions share values.
    """
    import torch

    generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
    values = torch.randn(like.shape, generator=generator, dtype=torch.float32)
    if like.dim() >= 2:
        values.mul_(1 / math.sqrt(like[0].numel()))
    else:
        values.mul_(VECTOR_STD)
        if key.endswith(".weight"):
            values.add_(1.0)
    return values.to(like.dtype)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], seed: str) -> None:
    """One safetensors file written tensor by tensor: meta tensors get ``random_tensor(f"{seed}/{name}")``,
    real ones their values.

    Byte for byte what safetensors' writer makes of the same tensors (its ``prepare``: sorted by descending
    dtype then name, compact JSON header with ``__metadata__`` first, padded with spaces to 8 bytes), with
    the ``{"format": "pt"}`` metadata diffusers and transformers write.
    """
    import torch

    order = sorted(tensors, key=lambda name: (-_SAFETENSORS_ORDER.index(_dtype_name(tensors[name])), name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _dtype_name(tensor),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for name in order:
            tensor = tensors[name]
            values = random_tensor(f"{seed}/{name}", tensor) if tensor.is_meta else tensor.contiguous()
            f.write(values.reshape(-1).view(torch.uint8).numpy().data)  # the bytes as they are, no copy


def _dtype_name(tensor: torch.Tensor) -> str:
    return _SAFETENSORS_NAMES[str(tensor.dtype).removeprefix("torch.")]


class _Diffusers:
    """diffusers' ModelMixin.save_pretrained (diffusers/models/modeling_utils.py): the whole state dict, its
    config via save_config, an index whose metadata is the split's."""

    pattern = "diffusion_pytorch_model{suffix}.safetensors"
    index = "diffusion_pytorch_model.safetensors.index.json"

    @staticmethod
    def state_dict(model: Any) -> dict[str, Any]:
        return dict(model.state_dict())

    @staticmethod
    def save_config(model: Any, folder: Path) -> None:
        model.save_config(folder)

    @staticmethod
    def index_metadata(model: Any) -> dict[str, Any]:
        return {}


class _Transformers:
    """transformers' PreTrainedModel.save_pretrained (transformers/modeling_utils.py): keys to ignore and tied
    copies dropped, checkpoint renamings reverted, dtype and architectures recorded in the config, the
    parameter count in the index."""

    pattern = "model{suffix}.safetensors"
    index = "model.safetensors.index.json"

    @staticmethod
    def state_dict(model: Any) -> dict[str, Any]:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        # accelerate's meta patch wraps every registered parameter anew, which unties shared ones (T5's embeddings):
        # tie them again, as from_pretrained does, so save_pretrained's tied-copy removal finds them.
        model.tie_weights()
        state = dict(model.state_dict())
        for key in model._keys_to_ignore_on_save or ():
            state.pop(key, None)
        # Tied copies are found by parameter identity, which meta tensors keep (it looks them up on the model).
        return dict(revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model)))

    @staticmethod
    def save_config(model: Any, folder: Path) -> None:
        model.config.dtype = str(model.dtype).removeprefix("torch.")
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
        if model.can_generate():
            model.generation_config.save_pretrained(folder)

    @staticmethod
    def index_metadata(model: Any) -> dict[str, Any]:
        return {"total_parameters": model.num_parameters()}


def _layout(model: Any) -> type[_Diffusers] | type[_Transformers]:
    from diffusers import ModelMixin

    return _Diffusers if isinstance(model, ModelMixin) else _Transformers
