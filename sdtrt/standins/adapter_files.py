"""The LoRA files an engine pipeline's adapters read that no user file holds (state dicts given to
``load_lora_weights``, PEFT adapters ``add_adapter`` made, a hotswap's combination): refit reads LoRAs from files, so
they are written to a folder the engines own, removed with them, or as soon as nothing reads them."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from ..core.errors import LoraError
from ..lora.files import LoraFile

OWN_FILES = "_sdtrt_lora_files"  # held by the registry's holder: the folder of its own LoRA files
# Held with it: adapter name → (its file, network → the LoraConfig add_adapter was given) for add_adapter's adapters.
ADDED = "_sdtrt_peft_adapters"


def own_file(owner: Any, name: str) -> Path:
    """A new path for adapter ``name``'s LoRA file in ``owner``'s folder (the network that holds the adapters: the
    files live as long as the engines that may read them again)."""
    folder = owner.__dict__.get(OWN_FILES)
    if folder is None:
        folder = owner.__dict__[OWN_FILES] = Path(tempfile.mkdtemp(prefix="sdtrt-loras-"))
        weakref.finalize(owner, shutil.rmtree, folder, True)
    readable = re.sub(r"[^\w.-]", "_", name)  # an adapter name is any string; a file name is not
    handle, path = tempfile.mkstemp(suffix=".safetensors", prefix=f"{readable}-", dir=folder)
    os.close(handle)
    return Path(path)


def added(owner: Any) -> dict[str, tuple[Path, dict[str, Any]]]:
    """add_adapter's adapters that ``owner`` holds (ADDED)."""
    return owner.__dict__.setdefault(ADDED, {})


def drop_unused(owner: Any, in_use: set[Path], adapter_files: set[Path]) -> None:
    """Remove ``owner``'s own LoRA files that nothing reads any more (``in_use``: the registry's files, baked LoRAs and
    the engines' LoRAs) and add_adapter's records of adapters no longer loaded from their file."""
    records = added(owner)
    for name in [n for n, (path, _) in records.items() if path not in adapter_files]:
        del records[name]
    folder = owner.__dict__.get(OWN_FILES)
    for path in folder.iterdir() if folder is not None else ():
        if path not in in_use:
            path.unlink(missing_ok=True)


def saved_state_dict(owner: Any, state_dict: dict[str, Any], name: str, where: str) -> Path:
    """A LoRA state dict (diffusers' or kohya's keys, as ``lora_state_dict`` reads them) written as ``owner``'s own
    safetensors file; its path."""
    import torch
    from safetensors.torch import save_file

    odd = next((k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)), None)
    if not state_dict or odd is not None:
        what = "is empty" if odd is None else f"holds {odd!r}, a {type(state_dict[odd]).__name__}"
        raise LoraError(f"{where}: the state dict {what}; pass a LoRA state dict of tensors, or its file")
    path = own_file(owner, name)
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state_dict.items()}, path)
    return path


def combined_file(owner: Any, name: str, new: LoraFile, old: LoraFile, kept: list[str]) -> Path:
    """One LoRA file with ``new``'s networks and ``old``'s ``kept`` ones (a hotswap keeps the networks its file lacks),
    as ``owner``'s own; each pair's alpha/rank is folded into its up weight, so the file needs no alphas."""
    from safetensors.torch import save_file

    parts = {**{c: old.parts[c] for c in kept}, **new.parts}
    tensors = {}
    for component, modules in parts.items():
        for module, pair in modules.items():
            tensors[f"{component}.{module}.lora_A.weight"] = pair.down.contiguous()
            tensors[f"{component}.{module}.lora_B.weight"] = (pair.up.float() * pair.scale).contiguous()
    path = own_file(owner, name)
    save_file(tensors, path)
    return path
