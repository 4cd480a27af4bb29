"""Where models come from: a local diffusers folder, a Hugging Face hub id, or an offline preset.

Presets are whole Stable Diffusion 1.x pipelines built from configs with a fixed seed (random
weights), saved once under the models cache and loaded from there afterwards, so every later stage
sees an ordinary diffusers folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import ModelNotFoundError, UnsupportedModelError

SourceKind = Literal["preset", "folder", "hub"]
PRESET_SEED = 0


@dataclass(frozen=True)
class ModelSource:
    """A resolved --model: always a local diffusers folder (pipeline root or bare UNet folder)."""

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

    def component_dir(self, folder: str) -> Path:
        """A pipeline's sub-folder (unet, text_encoder, vae, …); a bare UNet folder has only the UNet."""
        if folder == "unet":
            return self.unet_dir
        path = self.path / folder
        if not self.is_pipeline or not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model '{self.name}' has no {folder}/ with a config.json ({self.path})")
        return path

    def component_config(self, folder: str) -> dict[str, Any]:
        return json.loads((self.component_dir(folder) / "config.json").read_text())

    def component_class(self, folder: str) -> tuple[str, str]:
        """The library and class that load a sub-folder, as model_index.json names them."""
        index = json.loads((self.path / "model_index.json").read_text()) if self.is_pipeline else {}
        library, class_name = index.get(folder) or ("diffusers", self.component_config(folder).get("_class_name", ""))
        return str(library), str(class_name)

    def vae_scale_factor(self) -> int:
        """Pixels per latent; 8 for SD 1.x/2.x. A bare UNet folder is assumed to be SD-like."""
        vae_config = self.path / "vae" / "config.json"
        if not vae_config.is_file():
            return 8
        blocks = json.loads(vae_config.read_text()).get("block_out_channels", [0] * 4)
        return int(2 ** (len(blocks) - 1))

    def unet_digest(self) -> str:
        """sha256 over the UNet's config and weight files: the export stage's input identity."""
        return self.folder_digest("unet")

    def folder_digest(self, folder: str) -> str:
        """sha256 over a sub-folder's config and weight files."""
        h = hashlib.sha256()
        for f in sorted(p for p in self.component_dir(folder).iterdir() if p.is_file()):
            if f.suffix not in (".json", ".safetensors", ".bin"):
                continue
            h.update(f.name.encode() + b"\0")
            h.update(file_sha256(f).encode())
        return h.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "path": str(self.path)}


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def models_cache_dir() -> Path:
    return Path(os.environ.get("SDTRT_MODELS", Path.home() / ".cache" / "sdtrt" / "models"))


def resolve_model(model: str, cache_dir: Path | None = None) -> ModelSource:
    """Turn a --model value into a local diffusers folder, building or locating it as needed."""
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
        if not (path / "unet" / "config.json").is_file():
            raise ModelNotFoundError(f"'{path}' has model_index.json but no unet/config.json")
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


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """No loading bars or notices from diffusers and transformers while sdtrt loads a model: it shows its own progress.

    Their switches are process-wide, so each is restored afterwards; SDTRT_DEBUG=1 keeps the bars.
    """
    if os.environ.get("SDTRT_DEBUG", "") not in ("", "0"):
        yield
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    restore = []
    for lib in (diffusers_logging, transformers_logging):
        if lib.is_progress_bar_enabled():
            lib.disable_progress_bar()
            restore.append(lib.enable_progress_bar)
        # Their loading notices (e.g. transformers' "requires torchvision … falling back") are not the user's to act on.
        level = lib.get_verbosity()
        lib.set_verbosity(lib.ERROR)
        restore.append(lambda lib=lib, level=level: lib.set_verbosity(level))
    try:
        yield
    finally:
        for undo in restore:
            undo()


def load_unet(source: ModelSource, dtype: Any = None) -> Any:
    """The source's UNet2DConditionModel in eval mode (fp32 unless ``dtype`` says otherwise)."""
    from diffusers import UNet2DConditionModel

    with quiet_loading():
        unet = UNet2DConditionModel.from_pretrained(source.unet_dir, dtype=dtype, local_files_only=True)
    return unet.eval()


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


def check_supported_unet(config: dict[str, Any]) -> None:
    """Refuse UNets whose extra conditioning inputs the exported graph would silently drop."""
    extras = {
        "addition_embed_type": "SDXL-style added conditioning (text_embeds, time_ids)",
        "class_embed_type": "class-label conditioning",
        "time_cond_proj_dim": "LCM timestep_cond",
        "encoder_hid_dim_type": "projected encoder hidden states",
    }
    for key, what in extras.items():
        if config.get(key) is not None:
            raise UnsupportedModelError(
                f"this UNet uses {what} ({key}={config[key]!r}); sdtrt exports SD 1.x/2.x UNets "
                "(sample, timestep, encoder_hidden_states) only so far"
            )


# ---- presets ---------------------------------------------------------------------------------

PRESET_VERSION = 2


def ensure_preset(name: str, cache_dir: Path) -> Path:
    """The preset's folder, built on first use; an interrupted build leaves nothing behind."""
    dest = cache_dir / f"{name}-v{PRESET_VERSION}"
    if (dest / "model_index.json").is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        with quiet_loading():
            PRESETS[name]().save_pretrained(tmp, safe_serialization=True)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first; theirs is identical
            if not (dest / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _byte_level_tokenizer(folder: Path, max_length: int = 77) -> Any:
    """A CLIP tokenizer over a byte-level vocabulary: every text tokenizes, nothing is downloaded.

    transformers 5.x builds a 3-token vocabulary from CLIPTokenizer(vocab_file=…), so the files are
    written to a folder and loaded with from_pretrained.
    """
    from transformers import CLIPTokenizer

    byte_chars = _bytes_to_unicode()
    tokens = byte_chars + [c + "</w>" for c in byte_chars]
    merges = [("t", "h"), ("th", "e</w>"), ("a", "n"), ("an", "d</w>"), ("i", "n"), ("o", "n</w>")]
    tokens += ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=max_length)


def _bytes_to_unicode() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (the GPT-2/CLIP table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _sd1_pipeline(unet_kwargs: dict[str, Any], vae_kwargs: dict[str, Any], text_kwargs: dict[str, Any]) -> Any:
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(PRESET_SEED)
    unet = UNet2DConditionModel(**unet_kwargs)
    vae = AutoencoderKL(**vae_kwargs)
    with tempfile.TemporaryDirectory() as tok_dir:
        tokenizer = _byte_level_tokenizer(Path(tok_dir))
    text_config = CLIPTextConfig(
        vocab_size=max(len(tokenizer), text_kwargs.pop("vocab_size", 0)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=77,
        **text_kwargs,
    )
    text_encoder = CLIPTextModel(text_config)
    # Stable Diffusion 1.5's own scheduler config, including the clip_sample=False that other
    # schedulers (DDIM) read from it when built with from_config.
    scheduler = PNDMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False,
    )  # fmt: skip
    scheduler.register_to_config(clip_sample=False)  # type: ignore[attr-defined]  # ConfigMixin API
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip


def _tiny() -> Any:
    """A complete SD 1.x pipeline small enough for tests on two CPU cores (~1 M parameters)."""
    return _sd1_pipeline(
        unet_kwargs=dict(
            sample_size=32, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), norm_num_groups=16, cross_attention_dim=32,
            attention_head_dim=8,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        ),
        # Four VAE blocks make the VAE scale factor 8, as in real SD, so pixel sizes are realistic.
        vae_kwargs=dict(
            in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
            block_out_channels=(16, 16, 32, 32), norm_num_groups=16, sample_size=256,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        ),
        text_kwargs=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
    )  # fmt: skip


def _sd15_random() -> Any:
    """Stable Diffusion 1.5's architecture (UNet 859.5 M parameters) with random weights."""
    return _sd1_pipeline(
        unet_kwargs=dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8),
        vae_kwargs=dict(
            block_out_channels=(128, 256, 512, 512), latent_channels=4, layers_per_block=2, sample_size=512,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        ),
        text_kwargs=dict(
            vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, projection_dim=768,
        ),
    )  # fmt: skip


PRESETS: dict[str, Callable[[], Any]] = {"tiny": _tiny, "sd15-random": _sd15_random}
