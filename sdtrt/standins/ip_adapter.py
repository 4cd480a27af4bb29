"""diffusers' IP-Adapter API (``load_ip_adapter``, ``set_ip_adapter_scale``, ``unload_ip_adapter``) on an engine
pipeline whose denoiser engine (a UNet, Flux's transformer) was compiled with the adapter (``sdtrt compile
--ip-adapter PATH``).

The adapter's weights are in the engine, so the pipeline comes up with it loaded (scale 1, the image encoder and
feature extractor in place, as after diffusers' load_ip_adapter). ``load_ip_adapter`` of the same adapter loads it
again (another file is refused: the engine holds one), ``set_ip_adapter_scale`` takes a float or InstantStyle's
per-block dict (Flux: a float or one per block) and sets the engine's per-layer scales exactly as diffusers sets its
processors', and ``unload_ip_adapter`` leaves what diffusers' leaves: no image encoder, no projection, the plain
denoiser's images.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..core.errors import EngineInputError
from ..sources.ip_adapters import TOKENS, weights_digest
from ..spec import DenoiserSpec, UNetSpec
from ..spec.denoiser import IMAGE_EMBEDS, IP_SCALE

# How to get an engine set with an IP-Adapter: every refusal on a set without one ends with it.
RECOMPILE_WITH_IP_ADAPTER = "recompile with `sdtrt compile --ip-adapter PATH` (Python: ExportConfig(ip_adapter=PATH))"
NO_IP_ADAPTER = (
    "IP-Adapter adds image-projection inputs and attention layers to the denoiser, and this engine set was compiled "
    "without them: " + RECOMPILE_WITH_IP_ADAPTER
)


def image_projection(spec: DenoiserSpec) -> SimpleNamespace:
    """What diffusers' pipelines read of the denoiser's ``encoder_hid_proj`` to prepare IP images: one adapter's plain
    ImageProjection (its class decides the image encoder's output), weightless: the engine holds the weights."""
    from diffusers.models.embeddings import ImageProjection

    with torch.device("meta"):
        projection = ImageProjection(spec.image_embeds_dim, spec.cross_attention_dim, num_image_text_embeds=TOKENS)
    return SimpleNamespace(image_projection_layers=[projection], num_ip_adapters=1)


def no_image_encoder() -> Any:
    """An EngineUNet's IP-Adapter image encoder until load_pipeline gives it the one its engine was compiled with."""
    raise EngineInputError(
        "load_ip_adapter: this UNet engine's IP-Adapter image encoder was not loaded with it: make the pipeline with "
        "sdtrt.load_pipeline(model, engine)"
    )


def ip_denoiser(pipe: Any) -> Any:
    """The pipeline's denoiser engine (UNet or Flux transformer) if compiled with an IP-Adapter, else None."""
    denoiser = getattr(pipe, "unet", None) or getattr(pipe, "transformer", None)
    spec = getattr(denoiser, "spec", None)
    return denoiser if isinstance(spec, DenoiserSpec) and spec.ip_layers else None


def takes_ip_adapter(pipe: Any) -> bool:
    """Whether the pipeline's denoiser is an engine compiled with an IP-Adapter (its spec has the adapter's layers)."""
    return ip_denoiser(pipe) is not None


class IPAdapterInputs:
    """What a denoiser stand-in (EngineUNet, EngineTransformer) compiled with an IP-Adapter keeps: the layers' scales
    (1, as load_ip_adapter sets them), what the pipeline's prepare_ip_adapter_image_embeds reads of the projection
    (None: unloaded, as diffusers' unload leaves it), and the adapter's image encoder, which load_ip_adapter puts
    back."""

    spec: DenoiserSpec

    def init_ip_adapter(self) -> None:
        layers = len(self.spec.ip_layers)
        self.ip_scale = torch.ones(layers) if layers else None
        self.encoder_hid_proj = image_projection(self.spec) if layers else None
        self.ip_image_encoder: Callable[[], Any] = no_image_encoder

    def ip_adapter_inputs(self, embeds: Any, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The IP-Adapter's inputs: the image embeds prepare_ip_adapter_image_embeds made ([one adapter's]) and the
        layers' scales; zeros and scale 0 without an IP image (what the denoiser without the adapter computes)."""
        assert self.ip_scale is not None  # a denoiser with IP-Adapter layers
        if embeds is None:
            shape = (like.shape[0], 1, self.spec.image_embeds_dim)
            return {IMAGE_EMBEDS: like.new_zeros(shape), IP_SCALE: torch.zeros_like(self.ip_scale)}
        if not isinstance(embeds, list | tuple) or len(embeds) != 1 or embeds[0].shape[1] != 1:
            raise EngineInputError(
                "this engine takes one IP-Adapter's embeds of one image per prompt (ip_adapter_image=one image)"
            )
        return {IMAGE_EMBEDS: embeds[0], IP_SCALE: self.ip_scale}


def install(pipe: Any) -> None:
    """Bind the three methods to ``pipe``, whose denoiser engine has an IP-Adapter."""
    denoiser = ip_denoiser(pipe)  # an EngineUNet or EngineTransformer (takes_ip_adapter)
    layers = len(denoiser.spec.ip_layers)

    def load_ip_adapter(*args: Any, **kwargs: Any) -> None:
        # The pipeline's own signature: IPAdapterMixin's takes subfolder second, FluxIPAdapterMixin's weight_name.
        given = inspect.signature(type(pipe).load_ip_adapter).bind(pipe, *args, **kwargs).arguments
        names = ("pretrained_model_name_or_path_or_dict", "subfolder", "weight_name")
        where, subfolder, name = (one(given.get(k, "")) for k in names)
        file = adapter_file(where, subfolder, name)
        if weights_digest(file) != denoiser.spec.ip_adapter_digest:
            raise EngineInputError(
                f"load_ip_adapter: {file} is not the IP-Adapter this engine was compiled with; an engine holds "
                "its adapter: recompile with `sdtrt compile --ip-adapter` that file"
            )
        denoiser.encoder_hid_proj = image_projection(denoiser.spec)
        denoiser.ip_scale = torch.ones(layers)
        if getattr(pipe, "image_encoder", None) is None:
            pipe.register_modules(image_encoder=denoiser.ip_image_encoder())
        if getattr(pipe, "feature_extractor", None) is None:
            pipe.register_modules(feature_extractor=feature_extractor_for(denoiser.ip_image_encoder()))

    def set_ip_adapter_scale(scale: Any) -> None:
        denoiser.ip_scale = (
            unet_scales(denoiser, scale) if isinstance(denoiser.spec, UNetSpec) else flux_scales(scale, layers)
        )

    def unload_ip_adapter() -> None:
        if getattr(pipe, "image_encoder", None) is not None:
            pipe.image_encoder = None
            pipe.register_to_config(image_encoder=[None, None])
        if not hasattr(pipe, "safety_checker") and getattr(pipe, "feature_extractor", None) is not None:
            pipe.feature_extractor = None  # kept where the safety checker reads it, as diffusers keeps it
            pipe.register_to_config(feature_extractor=[None, None])
        denoiser.encoder_hid_proj = None
        denoiser.ip_scale = torch.zeros(layers)

    for method in (load_ip_adapter, set_ip_adapter_scale, unload_ip_adapter):
        setattr(pipe, method.__name__, method)


def adapter_file(where: Any, subfolder: str | None, name: str | None) -> Path:
    """The local file load_ip_adapter's arguments name (a hub id's in the local Hugging Face cache); EngineInputError
    for a state dict or what names no file here: the engine's adapter is checked by its file's digest."""
    refusal = (
        "load_ip_adapter: this engine holds its IP-Adapter, checked by its weight file's digest, and {what}; pass "
        "the folder (or hub id) and weight_name of the file the engine was compiled with"
    )
    if not isinstance(where, str | Path):
        raise EngineInputError(refusal.format(what="a state dict has no file"))
    if not name:
        raise EngineInputError(refusal.format(what="no weight_name was given"))
    file = Path(where, subfolder or "", name).expanduser()
    if not file.is_file() and isinstance(where, str) and where.count("/") == 1 and not Path(where).exists():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(where, f"{subfolder}/{name}" if subfolder else name)
        file = Path(cached) if isinstance(cached, str) else file
    if not file.is_file():
        raise EngineInputError(refusal.format(what=f"{file} is no file here (not in the Hugging Face cache either)"))
    return file


def one(value: Any) -> Any:
    """A load_ip_adapter argument for one adapter (diffusers takes a list per adapter); several are refused."""
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise EngineInputError("load_ip_adapter: this engine holds one IP-Adapter; load that one")
    return value[0]


def feature_extractor_for(image_encoder: Any) -> Any:
    """The CLIPImageProcessor diffusers' load_ip_adapter makes for a pipeline without one."""
    from transformers import CLIPImageProcessor

    size = image_encoder.config.image_size
    return CLIPImageProcessor(size=size, crop_size=size)


def unet_scales(unet: Any, scale: Any) -> torch.Tensor:
    """A UNet engine's per-layer scales for the scale config of its one adapter (a float, or InstantStyle's dict by
    block), as diffusers' IPAdapterMixin.set_ip_adapter_scale sets its processors': the dict expanded over the blocks
    by diffusers itself, each layer taking the value of every key it starts with, in order (a layer no key names
    keeps its scale)."""
    from diffusers.loaders.unet_loader_utils import _maybe_expand_lora_scales

    from ..sources.ip_adapters import empty_unet

    scales = scale if isinstance(scale, list) else [scale]
    if len(scales) != 1:
        raise EngineInputError(f"set_ip_adapter_scale: {len(scales)} scale configs for the engine's one IP-Adapter")
    scale = scales[0]
    assert unet.ip_scale is not None
    if isinstance(scale, list | tuple):  # diffusers' per-image form ([[0.5, 0.7]]: a scale per IP image)
        raise EngineInputError(
            f"set_ip_adapter_scale: {scale!r} gives a scale per IP image, and the engine takes one IP image: pass a "
            "float or InstantStyle's per-block dict"
        )
    if not isinstance(scale, dict):
        return torch.full_like(unet.ip_scale, float(scale))
    (expanded,) = _maybe_expand_lora_scales(empty_unet(dict(unet.config)), [scale], default_scale=0.0)
    out = unet.ip_scale.clone()
    for i, layer in enumerate(unet.spec.ip_layers):
        for prefix, value in expanded.items():
            if layer.startswith(prefix):
                out[i] = float(value)
    return out


def flux_scales(scale: Any, layers: int) -> torch.Tensor:
    """A Flux engine's per-layer scales, as diffusers' FluxIPAdapterMixin.set_ip_adapter_scale takes them for one
    adapter: a float for every double-stream block, or a list with one per block (alone, or in a list)."""
    if isinstance(scale, list) and len(scale) == 1 and isinstance(scale[0], list):
        scale = scale[0]
    if not isinstance(scale, list):
        return torch.full((layers,), float(scale))
    if len(scale) != layers:
        raise EngineInputError(f"set_ip_adapter_scale: {len(scale)} scales for the engine's {layers} IP-Adapter layers")
    return torch.tensor([float(s) for s in scale])
