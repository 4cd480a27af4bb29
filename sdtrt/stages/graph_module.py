"""A network as the module an exporter traces: positional tensor inputs and tensor outputs, in the order its graph
spec names them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..spec import (
    DenoiserSpec,
    GraphSpec,
    LLMEncoderSpec,
    QwenImageTransformerSpec,
    QwenVisionTowerSpec,
    TransformerPartSpec,
    UNetFreeUSpec,
    UNetPartSpec,
    ZImageTransformerSpec,
)
from ..spec.controlnet_samples import BLOCK_SAMPLE, SINGLE_BLOCK_SAMPLE
from ..spec.denoiser import IMAGE_EMBEDS, IP_SCALE

if TYPE_CHECKING:
    import torch


def graph_module(spec: GraphSpec, network: Any) -> torch.nn.Module:
    """The network with positional tensor inputs and tensor outputs, in the order its spec names them."""
    import torch

    def unet(
        sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, *extras: torch.Tensor
    ) -> torch.Tensor:
        return network(sample, timestep, encoder_hidden_states, **unet_extras(spec, extras), return_dict=False)[0]

    def controlnet(
        sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
        controlnet_cond: torch.Tensor, conditioning_scale: torch.Tensor, *extras: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        down, mid = network(
            sample, timestep, encoder_hidden_states, controlnet_cond, conditioning_scale,
            **unet_extras(spec, extras, first=5), return_dict=False,
        )  # fmt: skip
        return (*down, mid)

    def transformer(*inputs: torch.Tensor) -> torch.Tensor:
        # SD3's and Flux's graph inputs are named as their forward's keyword arguments; an IP-Adapter's image embeds go
        # in as FluxPipeline passes them (its scales: ip_adapter_call).
        given: dict[str, Any] = dict(zip(spec.canonical_inputs, inputs, strict=True))
        if IMAGE_EMBEDS in given:
            del given[IP_SCALE]
            given["joint_attention_kwargs"] = {"ip_adapter_image_embeds": [given.pop(IMAGE_EMBEDS)]}
        samples = controlnet_sample_lists(given)
        return network(**given, **samples, return_dict=False)[0]

    def flux_controlnet(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given: dict[str, Any] = dict(zip(spec.canonical_inputs, inputs, strict=True))
        # Scaled in the graph's dtype, so that an fp16 graph gives fp16 samples (the scale is an fp32 input).
        given["conditioning_scale"] = given["conditioning_scale"].to(given["hidden_states"].dtype)
        blocks, singles = network(**given, return_dict=False)
        return (*(blocks or ()), *(singles or ()))

    def t5(input_ids: torch.Tensor) -> torch.Tensor:
        return network(input_ids).last_hidden_state  # no attention mask, as SD3's and Flux's pipelines call it

    def text_encoder(input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = network(input_ids, output_hidden_states=True)
        # The penultimate layer is what `clip_skip=1` (and SDXL) read, before the final layer norm.
        return out.last_hidden_state, getattr(out, spec.canonical_outputs[1]), out.hidden_states[-2]

    def image_encoder(pixel_values: torch.Tensor) -> torch.Tensor:
        return network(pixel_values).image_embeds  # what encode_image reads for the plain IP-Adapter

    # A video VAE on one frame (Qwen-Image's): the frame axis added for it and taken out of what it gives.
    frame = getattr(spec, "single_frame", False)

    def vae_decoder(latent_sample: torch.Tensor) -> torch.Tensor:
        if frame:
            return network.decode(latent_sample.unsqueeze(2), return_dict=False)[0][:, :, 0]
        return network.decode(latent_sample, return_dict=False)[0]

    def vae_encoder(sample: torch.Tensor) -> torch.Tensor:
        if frame:
            return network.encode(sample.unsqueeze(2)).latent_dist.parameters[:, :, 0]
        return network.encode(sample).latent_dist.parameters  # mean and log-variance, stacked on channels

    # By component, or by the folder's class where a component's folder may hold several (T5 or CLIP).
    forward: dict[str, Callable[..., Any]] = {
        "T5EncoderModel": t5,
        "unet": unet,
        "transformer": transformer,
        "controlnet": controlnet,
        "FluxControlNetModel": flux_controlnet,
        "text_encoder": text_encoder,
        "text_encoder_2": text_encoder,
        "text_encoder_3": text_encoder,
        "vae_decoder": vae_decoder,
        "vae_encoder": vae_encoder,
        "image_encoder": image_encoder,
    }

    if isinstance(spec, LLMEncoderSpec):  # FLUX.2's Qwen3: the stacked hidden states its pipeline reads
        from .llm_encoder import llm_call

        forward[spec.architecture] = llm_call(network, spec)
    if isinstance(spec, QwenVisionTowerSpec):  # Qwen2.5-VL's vision tower, its grid reckoned outside the graph
        from .qwen_vision import vision_call

        forward[spec.component] = vision_call(network, spec)
    if isinstance(spec, ZImageTransformerSpec):  # its padded batch in, not diffusers' lists
        from .zimage_transformer import zimage_call

        forward[spec.architecture] = zimage_call(network, spec)
    if isinstance(spec, QwenImageTransformerSpec):  # its rotary embedding the graph's inputs
        from .qwen_transformer import qwen_transformer_call

        forward[spec.architecture] = qwen_transformer_call(network)
    if isinstance(spec, TransformerPartSpec):  # the transformer in parts, for step caches
        from .transformer_split import part_module

        # By the architecture too: a part's is its kind's, which names the whole call above (Qwen-Image's).
        forward[spec.component] = forward[spec.architecture] = part_module(spec, network)
    if isinstance(spec, UNetPartSpec):  # the UNet's DeepCache members
        from . import unet_split

        forward[spec.component] = unet_split.part_module(spec, network)
    if isinstance(spec, UNetFreeUSpec):  # the whole UNet, FreeU's factors its last input
        from .freeu import freeu_call

        forward[spec.component] = freeu_call(network, unet)
    elif isinstance(spec, DenoiserSpec) and spec.ip_layers:  # the IP-Adapter's per-layer scale an input
        from .ip_adapter import ip_adapter_call

        forward[spec.component] = ip_adapter_call(network, forward[spec.component], spec)

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.network = network  # registered, so the exporter sees its weights

        def forward(self, *inputs: torch.Tensor) -> Any:
            return forward.get(spec.architecture, forward[spec.component])(*inputs)

    return Graph().eval()


def unet_extras(spec: GraphSpec, extras: tuple[Any, ...], first: int = 3) -> dict[str, Any]:
    """The network's keyword inputs from the graph's inputs after the ``first`` positional ones.

    SDXL's ``text_embeds``/``time_ids`` and an IP-Adapter's ``image_embeds`` (a list: one adapter) become
    ``added_cond_kwargs``, LCM's ``timestep_cond`` stays, ControlNet residuals become
    ``down_block_additional_residuals`` + ``mid_block_additional_residual``.
    """
    given = dict(zip(spec.canonical_inputs[first:], extras, strict=True))
    kwargs: dict[str, Any] = {"timestep_cond": given.get("timestep_cond")}
    added = {"text_embeds": given["text_embeds"], "time_ids": given["time_ids"]} if "text_embeds" in given else {}
    if "image_embeds" in given:
        added["image_embeds"] = [given["image_embeds"]]
    if added:
        kwargs["added_cond_kwargs"] = added
    if "mid_block_res" in given:
        kwargs["down_block_additional_residuals"] = tuple(
            v for k, v in given.items() if k.startswith("down_block_res_")
        )
        kwargs["mid_block_additional_residual"] = given["mid_block_res"]
    return kwargs


def controlnet_sample_lists(given: dict[str, Any]) -> dict[str, Any]:
    """A FLUX.1 ControlNet set's transformer inputs (taken out of ``given``) as the lists its forward adds after its
    blocks: the double blocks', the single blocks' (None for none); {} without them."""
    blocks = [given.pop(k) for k in list(given) if k.startswith(BLOCK_SAMPLE)]
    singles = [given.pop(k) for k in list(given) if k.startswith(SINGLE_BLOCK_SAMPLE)]
    if not (blocks or singles):
        return {}
    return {"controlnet_block_samples": blocks or None, "controlnet_single_block_samples": singles or None}


def block_patches(spec: GraphSpec) -> dict[tuple[Any, str], Any]:
    """What the graph's forward replaces inside the network's blocks, for a block run alone on the graph's inputs:
    Qwen-Image's rotary product on (cos, sin) pairs, where diffusers' takes complex numbers, and Z-Image's attention
    rotating by real (cos, sin) factors."""
    if isinstance(spec, QwenImageTransformerSpec):
        from .qwen_transformer import rotary_patches

        return rotary_patches()
    if isinstance(spec, ZImageTransformerSpec):
        from .zimage_transformer import rotary_patches as zimage_rotary

        return zimage_rotary()
    return {}
