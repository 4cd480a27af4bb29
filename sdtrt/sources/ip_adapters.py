"""IP-Adapter files: where an adapter's weights and image encoder are, read in h94/IP-Adapter's published layout, and a
random one for the tiny presets, made offline in that layout.

The layout (what diffusers' ``IPAdapterMixin.load_ip_adapter`` reads): a ``.safetensors`` (or ``.bin``) file with
``image_proj.*`` (the image projection: ``proj`` a Linear to 4 tokens of the UNet's text width, ``norm`` a LayerNorm)
and ``ip_adapter.{1,3,5,…}.to_k_ip.weight`` / ``.to_v_ip.weight`` (one pair per cross-attention layer, in
``unet.attn_processors``' order, odd numbers), and an ``image_encoder/`` folder beside it holding a
CLIPVisionModelWithProjection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import ModelNotFoundError, UnsupportedModelError
from ..core.integrity import file_sha256

if TYPE_CHECKING:
    import torch

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
        return file_sha256(self.weights)

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
        """{"image_proj": …, "ip_adapter": …}, as load_ip_adapter splits the file; UnsupportedModelError for the
        adapters whose projection is not the plain one (Plus, Full, FaceID): they are not built yet."""
        import torch

        if self.weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            flat = load_file(self.weights)
            state: dict[str, dict[str, torch.Tensor]] = {"image_proj": {}, "ip_adapter": {}}
            for key, value in flat.items():
                group, _, name = key.partition(".")
                if group in state:
                    state[group][name] = value
        else:
            state = torch.load(self.weights, map_location="cpu", weights_only=True)
        if "proj.weight" not in state.get("image_proj", {}) or "norm.weight" not in state["image_proj"]:
            raise UnsupportedModelError(
                f"{self.weights.name} is not a plain IP-Adapter (image_proj.proj + image_proj.norm): sdtrt builds "
                "those only; IP-Adapter Plus, Full and FaceID run on PyTorch (load_pipeline without an engine)"
            )
        return state


def resolve_ip_adapter(path: str | Path) -> IPAdapterFiles:
    """``path``: the adapter's weight file, or a folder holding exactly one; its ``image_encoder/`` beside it."""
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
    if not where.is_file() or where.suffix not in WEIGHT_SUFFIXES:
        raise ModelNotFoundError(
            f"--ip-adapter {path}: no such .safetensors or .bin file; pass a local IP-Adapter weight file (download "
            "a hub one first: hf download h94/IP-Adapter --include 'models/ip-adapter_sd15.safetensors' "
            "'models/image_encoder/*')"
        )
    encoder = where.parent / IMAGE_ENCODER
    if not (encoder / "config.json").is_file():
        raise ModelNotFoundError(f"--ip-adapter {where}: no {IMAGE_ENCODER}/ with a config.json beside it")
    return IPAdapterFiles(where.resolve(), encoder.resolve())


def ip_layers(unet_config: dict[str, Any]) -> tuple[str, ...]:
    """The attention processors an IP-Adapter adds to, in ``unet.attn_processors``' order (its weights' order): the
    cross-attention ones, as diffusers' _convert_ip_adapter_attn_to_diffusers picks them."""
    return tuple(name for name, _ in _cross_attention(unet_config))


def empty_unet(unet_config: dict[str, Any]) -> Any:
    """A UNet2DConditionModel of this config without weights: its layers' names and shapes."""
    from diffusers import UNet2DConditionModel

    from .random_weights import empty_weights

    with empty_weights():
        return UNet2DConditionModel.from_config(unet_config)


def _cross_attention(unet_config: dict[str, Any]) -> list[tuple[str, Any]]:
    """(processor name, Attention module) of a UNet with this config's cross-attention layers."""
    unet = empty_unet(unet_config)
    return [
        (name, unet.get_submodule(name.removesuffix(".processor")))
        for name in unet.attn_processors
        if not name.endswith("attn1.processor") and "motion_modules" not in name
    ]


def random_ip_adapter(model: ModelSource, folder: Path, *, seed: int = 0) -> IPAdapterFiles:
    """A random plain IP-Adapter for ``model``'s UNet, written into ``folder`` in h94/IP-Adapter's layout (weight file
    + tiny image_encoder/): what tests and demos load where no adapter can be downloaded. Seeded: the same files every
    time. Weights are drawn at each Linear's default scale (1/√fan-in), so the image branch moves the output."""
    import torch
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = model.unet_config()
    text_width = config["cross_attention_dim"]
    torch.manual_seed(seed)
    vision = CLIPVisionModelWithProjection(CLIPVisionConfig(**TINY_IMAGE_ENCODER))
    vision.save_pretrained(folder / IMAGE_ENCODER)
    generator = torch.Generator().manual_seed(seed)

    def linear(rows: int, columns: int) -> torch.Tensor:
        return torch.randn(rows, columns, generator=generator) / columns**0.5

    embeds = vision.config.projection_dim
    tensors = {
        "image_proj.proj.weight": linear(TOKENS * text_width, embeds),
        "image_proj.proj.bias": torch.randn(TOKENS * text_width, generator=generator) * 0.02,
        "image_proj.norm.weight": 1 + torch.randn(text_width, generator=generator) * 0.02,
        "image_proj.norm.bias": torch.randn(text_width, generator=generator) * 0.02,
    }
    for index, (_, attention) in enumerate(_cross_attention(config)):
        key = 2 * index + 1  # the published files number the cross-attention layers 1, 3, 5, …
        width = attention.query_dim
        tensors[f"ip_adapter.{key}.to_k_ip.weight"] = linear(width, text_width)
        tensors[f"ip_adapter.{key}.to_v_ip.weight"] = linear(width, text_width)
    save_file(tensors, folder / RANDOM_WEIGHTS)
    return IPAdapterFiles((folder / RANDOM_WEIGHTS).resolve(), (folder / IMAGE_ENCODER).resolve())
