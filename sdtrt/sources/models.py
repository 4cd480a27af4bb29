"""Where models come from: a local diffusers folder, a Hugging Face hub id, or an offline preset.

Presets (presets.py, built by preset_build.py) are whole pipelines built from configs with a fixed seed
(random weights), saved once under the models cache and loaded from there afterwards, so every later stage sees an
ordinary diffusers folder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..core.errors import ModelNotFoundError, UnsupportedModelError
from ..core.integrity import file_sha256
from ..core.progress import quiet_loading

SourceKind = Literal["preset", "folder", "hub"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved --model: always a local diffusers folder (pipeline root or bare UNet folder).

    A pipeline's denoiser is its unet/ (SD 1.x/2.x, SDXL) or its transformer/ (SD3, Flux).
    """

    name: str
    kind: SourceKind
    path: Path

    @property
    def is_pipeline(self) -> bool:
        return (self.path / "model_index.json").is_file()

    @property
    def unet_dir(self) -> Path:
        return self.path / "unet" if self.is_pipeline else self.path

    def unet_config(self) -> dict[str, Any]:
        return json.loads((self.unet_dir / "config.json").read_text())

    @property
    def denoiser_folder(self) -> str:
        """unet, or transformer for a pipeline with a transformer/ and no unet/ (a bare folder is a UNet)."""
        return "transformer" if self.is_pipeline and not self.has("unet") and self.has("transformer") else "unet"

    def denoiser_config(self) -> dict[str, Any]:
        return self.component_config(self.denoiser_folder)

    def component_dir(self, folder: str) -> Path:
        """A pipeline's sub-folder (unet, text_encoder, vae, …); a bare UNet folder has only the UNet."""
        if folder == "unet":
            return self.unet_dir
        path = self.path / folder
        if not self.is_pipeline or not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model '{self.name}' has no {folder}/ with a config.json ({self.path})")
        return path

    def pipeline_class(self) -> str:
        """The diffusers pipeline class ``model_index.json`` names; ModelNotFoundError for a bare UNet folder."""
        if not self.is_pipeline:
            raise ModelNotFoundError(f"'{self.path}' is a bare UNet folder; a pipeline needs the whole model folder")
        return str(json.loads((self.path / "model_index.json").read_text()).get("_class_name", ""))

    def has(self, folder: str) -> bool:
        """Whether this is a pipeline folder with that sub-folder (SDXL's refiner has no text_encoder/)."""
        return self.is_pipeline and (self.path / folder / "config.json").is_file()

    def component_config(self, folder: str) -> dict[str, Any]:
        return json.loads((self.component_dir(folder) / "config.json").read_text())

    def component_class(self, folder: str) -> tuple[str, str]:
        """The library and class that load a sub-folder, as model_index.json names them."""
        index = json.loads((self.path / "model_index.json").read_text()) if self.is_pipeline else {}
        library, class_name = index.get(folder) or ("diffusers", self.component_config(folder).get("_class_name", ""))
        return str(library), str(class_name)

    def family(self) -> str:
        """sd1, sd2, sdxl, sdxl-refiner (+ -inpaint, -lcm, -v), sd3, flux, flux-schnell: see families."""
        from ..core.families import family_name, transformer_family

        if self.denoiser_folder == "transformer":
            return transformer_family(self.denoiser_config())
        scheduler = self.path / "scheduler" / "scheduler_config.json"
        scheduler_config = json.loads(scheduler.read_text()) if self.is_pipeline and scheduler.is_file() else None
        return family_name(self.unet_config(), scheduler_config, self.pooled_text_dim(), self.has("controlnet"))

    def pooled_text_dim(self) -> int | None:
        """SDXL's pooled text embedding width: text_encoder_2's projection_dim (None without one)."""
        return self.component_config("text_encoder_2").get("projection_dim") if self.has("text_encoder_2") else None

    def vae_scale_factor(self) -> int:
        """Pixels per latent; 8 for SD 1.x/2.x. A bare UNet folder is assumed to be SD-like."""
        vae_config = self.path / "vae" / "config.json"
        if not vae_config.is_file():
            return 8
        config = json.loads(vae_config.read_text())
        if "temperal_downsample" in config:  # Qwen-Image's video VAE: a spatial halving per temporal stage
            return int(2 ** len(config["temperal_downsample"]))
        return int(2 ** (len(config.get("block_out_channels", [0] * 4)) - 1))

    def denoiser_digest(self) -> str:
        """sha256 over the denoiser's (UNet's or transformer's) config and weight files."""
        return self.folder_digest(self.denoiser_folder)

    def folder_digest(self, folder: str) -> str:
        """sha256 over a sub-folder's config and weight files."""
        return network_digest(self.component_dir(folder))

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "path": str(self.path)}


@functools.lru_cache(maxsize=256)
def _weights_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """A weight file's sha256, hashed once per process while its size, mtime and inode stay: one command keys a
    model's folders several times (export, engine pairing), and a 24 GB transformer takes a minute to hash."""
    return file_sha256(Path(path))


def models_cache_dir() -> Path:
    return Path(os.environ.get("SDTRT_MODELS", Path.home() / ".cache" / "sdtrt" / "models"))


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelSource:
    """Turn a --model value into a local diffusers folder, building or locating it as needed."""
    from .preset_build import ensure_preset
    from .presets import PRESETS

    if model in PRESETS:
        return ModelSource(model, "preset", ensure_preset(model, cache_dir or models_cache_dir()))
    path = Path(model).expanduser()
    if path.exists():
        return ModelSource(model, "folder", _check_diffusers_folder(path))
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        return ModelSource(model, "hub", _hub_snapshot(model))
    raise ModelNotFoundError(
        f"model '{model}' is not a preset ({', '.join(PRESETS)}), an existing folder, or a hub id "
        "(org/name); pass one of those, e.g. --model tiny"
    )


def _check_diffusers_folder(path: Path) -> Path:
    if not path.is_dir():
        raise ModelNotFoundError(f"model path '{path}' is a file; pass the diffusers model folder")
    if (path / "model_index.json").is_file():
        transformer = path / "transformer" / "config.json"
        if not (path / "unet" / "config.json").is_file() and not transformer.is_file():
            raise ModelNotFoundError(
                f"'{path}' has model_index.json but neither unet/ nor transformer/ with a config.json"
            )
        if transformer.is_file() and not (path / "unet").is_dir():
            from ..core.families import transformer_family

            transformer_family(json.loads(transformer.read_text()))  # refuses transformers sdtrt does not support
        return path.resolve()
    config = path / "config.json"
    if config.is_file() and "UNet2DConditionModel" in config.read_text():
        return path.resolve()
    raise ModelNotFoundError(
        f"'{path}' is not a diffusers model: it has neither model_index.json (a pipeline) nor a "
        "UNet2DConditionModel config.json; pass the folder `save_pretrained` wrote, or a preset"
    )


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.txt", "*.safetensors"]))
    except Exception as exc:  # the hub client raises many unrelated types for offline/missing
        raise ModelNotFoundError(
            f"hub model '{repo_id}' could not be found or downloaded ({type(exc).__name__}); "
            "download it where the hub is reachable and pass its local folder, or use a preset"
        ) from exc


def load_unet(source: ModelSource, dtype: Any = None) -> Any:
    """The source's UNet2DConditionModel in eval mode (fp32 unless ``dtype`` says otherwise)."""
    from diffusers import UNet2DConditionModel

    with quiet_loading():
        unet = UNet2DConditionModel.from_pretrained(source.unet_dir, dtype=dtype, local_files_only=True)
    return unet.eval()


def network_digest(directory: Path) -> str:
    """sha256 over a network folder's config and weight files (a model's sub-folder, an IP-Adapter's image encoder)."""
    h = hashlib.sha256()
    for f in sorted(p for p in directory.iterdir() if p.is_file()):
        if f.suffix not in (".json", ".safetensors", ".bin"):
            continue
        h.update(f.name.encode() + b"\0")
        stat = f.stat()
        h.update(_weights_sha256(str(f.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino).encode())
    return h.hexdigest()


def load_folder(source: ModelSource, folder: str, dtype: Any = None) -> Any:
    """A pipeline sub-folder's network (UNet, text encoder, VAE) in eval mode, by the class model_index.json names."""
    import importlib

    if folder == "unet":
        return load_unet(source, dtype)
    library, class_name = source.component_class(folder)
    # Only the named library: asking diffusers for a transformers class makes it import (and warn about) a lot.
    cls = (
        getattr(importlib.import_module(library), class_name, None)
        if library in ("diffusers", "transformers")
        else None
    )
    if cls is None:
        raise UnsupportedModelError(
            f"{folder}/ of '{source.name}' is a {class_name or 'class without a name'}, which sdtrt cannot load"
        )
    with quiet_loading():
        module = cls.from_pretrained(source.component_dir(folder), dtype=dtype, local_files_only=True)
    return module.eval()
