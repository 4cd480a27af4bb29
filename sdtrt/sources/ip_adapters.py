"""IP-Adapter files: where an adapter's weights and image encoder are, read in h94/IP-Adapter's published layout, and a
random one for the tiny presets, made offline in that layout.

The layout (what diffusers' ``IPAdapterMixin.load_ip_adapter`` reads): a ``.safetensors`` (or ``.bin``) file with
``image_proj.*`` (the image projection: ``proj`` a Linear to 4 tokens of the UNet's text width, ``norm`` a LayerNorm)
and ``ip_adapter.{1,3,5,…}.to_k_ip.weight`` / ``.to_v_ip.weight`` (one pair per cross-attention layer, in
``unet.attn_processors``' order, odd numbers), and an ``image_encoder/`` folder beside it holding a
CLIPVisionModelWithProjection. Flux's (XLabs', as ``FluxIPAdapterMixin`` reads them) name the projection
``ip_adapter_proj_model.*`` and the layers ``double_blocks.{0,1,…}.processor.ip_adapter_double_stream_{k,v}_proj.*``
(with biases), one per double-stream block.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ConfigError, ModelNotFoundError
from ..core.integrity import file_sha256

if TYPE_CHECKING:
    import torch

    from ..core.config import ExportConfig
    from .models import ModelSource

WEIGHT_SUFFIXES = (".safetensors", ".bin")
IMAGE_ENCODER = "image_encoder"
RANDOM_WEIGHTS = "ip-adapter.safetensors"  # random_ip_adapter's file name
# random_ip_adapter's image encoder: a CLIP vision tower as small as the tiny presets' text encoders.
TINY_IMAGE_ENCODER: dict[str, Any] = dict(hidden_size=32, intermediate_size=37, projection_dim=32, num_hidden_layers=2,
                          num_attention_heads=4, image_size=32, patch_size=8)  # fmt: skip
TOKENS = 4  # image tokens of the plain IP-Adapter's projection (diffusers' ImageProjection for "proj.weight")


@dataclass(frozen=True)
class IPAdapterFiles:
    """An IP-Adapter: its weight file and the folder of the image encoder it was trained with."""

    weights: Path
    image_encoder: Path

    def digest(self) -> str:
        return weights_digest(self.weights)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{"image_proj.proj.weight": shape, "ip_adapter.1.to_k_ip.weight": shape, …} in state_dict's names, read
        from the safetensors header (a .bin file is loaded): what the checks before any export read."""
        if self.weights.suffix != ".safetensors":
            return {f"{group}.{name}": tuple(t.shape) for group, part in self.state_dict().items()
                    for name, t in part.items()}  # fmt: skip
        from safetensors import safe_open

        with safe_open(self.weights, "pt") as file:
            return {_grouped(key): tuple(file.get_slice(key).get_shape()) for key in file.keys()}  # noqa: SIM118

    def image_encoder_config(self) -> dict[str, Any]:
        return dict(json.loads((self.image_encoder / "config.json").read_text()))

    def image_encoder_digest(self) -> str:
        from .models import network_digest

        return network_digest(self.image_encoder)

    def load_image_encoder(self, dtype: torch.dtype | None = None) -> Any:
        """The CLIPVisionModelWithProjection, in eval mode, as load_ip_adapter loads it."""
        from transformers import CLIPVisionModelWithProjection

        from ..core.progress import quiet_loading

        with quiet_loading():
            encoder = CLIPVisionModelWithProjection.from_pretrained(self.image_encoder, dtype=dtype)
        return encoder.eval()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"image_proj": …, "ip_adapter": …}, as load_ip_adapter splits the file; ConfigError for the adapters whose
        projection is not the plain one (Plus, Full, FaceID): they are not built yet."""
        import torch

        if self.weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
            for key, value in load_file(self.weights).items():
                group, _, name = _grouped(key).partition(".")
                if group in state:
                    state[group][name] = value
        else:
            state = torch.load(self.weights, map_location="cpu", weights_only=True)
        self.check_plain(set(state.get("image_proj", {})))
        return state

    def check_plain(self, projection: set[str]) -> None:
        if not {"proj.weight", "norm.weight"} <= projection:
            raise ConfigError(
                f"{self.weights.name} is not a plain IP-Adapter (image_proj.proj + image_proj.norm): sdtrt builds "
                "those only; IP-Adapter Plus, Full and FaceID run on PyTorch (load_pipeline without an engine)"
            )

    def misfit(self, model: ModelSource) -> str | None:
        """Why this adapter and its image encoder cannot go into ``model``'s denoiser (None where they fit), read
        from the file's header and the configs: the projection's width against the model's text width, the
        attention layers' count and shapes against the model's, the encoder's output against the projection's."""
        shapes = self.shapes()
        self.check_plain({k.removeprefix("image_proj.") for k in shapes if k.startswith("image_proj.")})
        width_key = text_width_key(model)
        text_width = model.denoiser_config()[width_key]
        projection_in = shapes["image_proj.proj.weight"][1]
        if (norm := shapes["image_proj.norm.weight"][0]) != text_width:
            return f"its image projection makes {norm}-wide tokens and {model.name}'s {width_key} is {text_width}"
        if (encoder := self.image_encoder_config().get("projection_dim")) != projection_in:
            return (f"its image projection takes {projection_in}-wide image embeds and the image encoder "
                    f"{self.image_encoder} makes {encoder}: pass the encoder it was trained with "
                    "(--ip-adapter-image-encoder DIR)")  # fmt: skip
        keys = sorted((k for k in shapes if k.endswith("to_k_ip.weight")), key=lambda k: int(k.split(".")[1]))
        attention = _ip_attention(model)
        if len(keys) != len(attention):
            return f"it has {len(keys)} attention layers and {model.name}'s denoiser {len(attention)}"
        flux = model.denoiser_folder == "transformer"
        for key, (name, layer) in zip(keys, attention, strict=True):
            want = (layer.inner_dim if flux else layer.query_dim, text_width)
            if shapes[key] != want:
                return f"its {key} is {list(shapes[key])} and {model.name}'s {name} takes {list(want)}"
        return None


def weights_digest(path: Path) -> str:
    """The weight file's sha256, hashed once per process while its size, mtime and inode stay."""
    stat = path.stat()
    return _weights_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=16)
def _weights_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return file_sha256(Path(path))


def text_width_key(model: ModelSource) -> str:
    """The denoiser config's key of the width an IP-Adapter's tokens have: a UNet's text width, Flux's joint one."""
    return "joint_attention_dim" if model.denoiser_folder == "transformer" else "cross_attention_dim"


def _grouped(key: str) -> str:
    """A file's tensor name in state_dict's groups: XLabs' (Flux) projection and layers as h94's are named."""
    group, _, name = key.partition(".")
    if group == "ip_adapter_proj_model":
        return f"image_proj.{name}"
    if group == "double_blocks":
        return f"ip_adapter.{xlabs_renamed(name)}"
    return key


def ip_adapter_files(config: ExportConfig) -> IPAdapterFiles:
    """The IP-Adapter an export config names (its weight file, and its image encoder folder where given)."""
    return resolve_ip_adapter(config.ip_adapter, config.ip_adapter_image_encoder or None)


def resolve_ip_adapter(path: str | Path, image_encoder: str | Path | None = None) -> IPAdapterFiles:
    """``path``: the adapter's weight file, or a folder holding exactly one; its image encoder ``image_encoder``
    (diffusers' image_encoder_folder), or the ``image_encoder/`` beside it."""
    where = Path(path).expanduser()
    if where.is_dir():
        found = sorted(p for p in where.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise ModelNotFoundError(
                f"--ip-adapter {where}: a folder must hold one .safetensors or .bin weight file ({names}); pass the "
                "file itself"
            )
        where = found[0]
    if where.is_file() and where.suffix not in WEIGHT_SUFFIXES:
        raise ModelNotFoundError(
            f"--ip-adapter {path}: a {where.suffix or 'suffix-less'} file is no IP-Adapter weight file (.safetensors"
            " or .bin); the image to condition on goes to `sdtrt generate --ip-adapter-image`"
        )
    if not where.is_file():
        raise ModelNotFoundError(
            f"--ip-adapter {path}: no such .safetensors or .bin file; pass a local IP-Adapter weight file (download "
            "a hub one first: hf download h94/IP-Adapter --include 'models/ip-adapter_sd15.safetensors' "
            "'models/image_encoder/*')"
        )
    encoder = Path(image_encoder).expanduser() if image_encoder else where.parent / IMAGE_ENCODER
    if not (encoder / "config.json").is_file():
        what = f"--ip-adapter-image-encoder {encoder}: no config.json in it" if image_encoder else (
            f"--ip-adapter {where}: no {IMAGE_ENCODER}/ with a config.json beside it; pass its image encoder's folder "
            "with --ip-adapter-image-encoder")  # fmt: skip
        raise ModelNotFoundError(what)
    return IPAdapterFiles(where.resolve(), encoder.resolve())


def xlabs_renamed(name: str) -> str:
    """An XLabs (Flux) attention weight's name as diffusers' FluxIPAdapterMixin renames it ("0.to_k_ip.weight")."""
    for xlabs, diffusers in (("ip_adapter_double_stream_k_proj", "to_k_ip"), ("ip_adapter_double_stream_v_proj",
                             "to_v_ip"), ("processor.", "")):  # fmt: skip
        name = name.replace(xlabs, diffusers)
    return name


def ip_layers(model: ModelSource) -> tuple[str, ...]:
    """The attention processors an IP-Adapter adds to, in ``attn_processors``' order (its weights' order), as diffusers'
    _convert_ip_adapter_attn_to_diffusers picks them: a UNet's cross-attention ones, Flux's double-stream blocks'."""
    return tuple(name for name, _ in _ip_attention(model))


def empty_unet(unet_config: dict[str, Any]) -> Any:
    """A UNet2DConditionModel of this config without weights: its layers' names and shapes."""
    from diffusers import UNet2DConditionModel

    return _empty(UNet2DConditionModel, unet_config)


def _empty(cls: Any, config: dict[str, Any]) -> Any:
    from .random_weights import empty_weights

    with empty_weights():
        return cls.from_config(config)


def _ip_attention(model: ModelSource) -> list[tuple[str, Any]]:
    """(processor name, Attention module) of the denoiser's layers an IP-Adapter adds to."""
    if model.denoiser_folder == "transformer":
        from diffusers import FluxTransformer2DModel

        network = _empty(FluxTransformer2DModel, model.denoiser_config())
        names = [name for name in network.attn_processors if not name.startswith("single_transformer_blocks")]
    else:
        network = empty_unet(model.unet_config())
        names = [n for n in network.attn_processors if not n.endswith("attn1.processor") and "motion_modules" not in n]
    return [(name, network.get_submodule(name.removesuffix(".processor"))) for name in names]


def random_ip_adapter(model: ModelSource, folder: Path, *, seed: int = 0) -> IPAdapterFiles:
    """A random plain IP-Adapter for ``model``'s denoiser, written into ``folder`` in the published layout (h94's for
    a UNet, XLabs' for Flux: weight file + tiny image_encoder/): what tests and demos load where no adapter can be
    downloaded. Seeded: the same files every time. Weights are drawn at each Linear's default scale (1/√fan-in), so
    the image branch moves the output."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    flux = model.denoiser_folder == "transformer"
    text_width = model.denoiser_config()[text_width_key(model)]
    torch.manual_seed(seed)
    vision = CLIPVisionModelWithProjection(CLIPVisionConfig(**TINY_IMAGE_ENCODER))
    vision.save_pretrained(folder / IMAGE_ENCODER)
    generator = torch.Generator().manual_seed(seed)

    def linear(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator) / columns**0.5

    def vector(size: int, mean: float = 0.0) -> torch.Tensor:
        return mean + torch.randn(size, generator=generator) * 0.02

    projection = "ip_adapter_proj_model" if flux else "image_proj"
    tensors = {
        f"{projection}.proj.weight": linear(TOKENS * text_width, vision.config.projection_dim),
        f"{projection}.proj.bias": vector(TOKENS * text_width),
        f"{projection}.norm.weight": vector(text_width, 1.0),
        f"{projection}.norm.bias": vector(text_width),
    }
    for index, (_, attention) in enumerate(_ip_attention(model)):
        width = attention.inner_dim if flux else attention.query_dim
        for kind in ("k", "v"):
            if flux:  # XLabs number the double-stream blocks 0, 1, …; their projections have biases
                name = f"double_blocks.{index}.processor.ip_adapter_double_stream_{kind}_proj"
                tensors[f"{name}.bias"] = vector(width)
            else:  # h94 number the cross-attention layers 1, 3, 5, …
                name = f"ip_adapter.{2 * index + 1}.to_{kind}_ip"
            tensors[f"{name}.weight"] = linear(width, text_width)
    save_file(tensors, folder / RANDOM_WEIGHTS)
    return IPAdapterFiles((folder / RANDOM_WEIGHTS).resolve(), (folder / IMAGE_ENCODER).resolve())
