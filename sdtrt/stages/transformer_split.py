"""A transformer cut where step caches need it: embedders | first block | the other blocks | output head.

Each part is a module over the diffusers network's own submodules (its embedders, blocks, norm_out and proj_out),
called as the network's forward calls them, so the four parts chained compute what the whole forward computes:
``tests/test_step_cache.py`` checks that on SD3's, Flux's and Qwen-Image's classes. What passes between the parts: the
embedded image and text tokens, the conditioning embedding ``temb`` and the kind's block extras: Flux's rotary
embedding (cos, sin), computed once by the embedders' part; Qwen-Image's text mask and rotary angles, the whole
graph's inputs (stages/qwen_transformer.py); FLUX.2's rotary embedding and modulations, computed by its embedders'
part as its forward computes them once, outside the blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..spec.transformer_split import FLUX2_DOUBLE_MODULATIONS, FLUX2_SINGLE_MODULATION, TransformerPartSpec
from .patches import replaced
from .qwen_transformer import rotary_patches

if TYPE_CHECKING:
    import torch


def part_module(spec: TransformerPartSpec, network: Any) -> Any:
    """The callable an exporter traces for one part: positional tensors in, tensors out, in the spec's order."""
    forward = KIND_PARTS[spec.architecture][spec.component]

    def call(*inputs: torch.Tensor) -> Any:
        return forward(network, **dict(zip(spec.canonical_inputs, inputs, strict=True)))

    return call


# ---- Flux.1 (FluxTransformer2DModel.forward, diffusers 0.42) ---------------------------------------------------


def _flux_embed(net: Any, hidden_states: Any, encoder_hidden_states: Any, pooled_projections: Any, timestep: Any,
                img_ids: Any, txt_ids: Any, guidance: Any = None) -> tuple[Any, ...]:  # fmt: skip
    import torch

    hidden = net.x_embedder(hidden_states)
    timestep = timestep.to(hidden.dtype) * 1000
    if guidance is None:
        temb = net.time_text_embed(timestep, pooled_projections)
    else:
        temb = net.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled_projections)
    cos, sin = net.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    return hidden, net.context_embedder(encoder_hidden_states), temb, cos, sin


def _flux_blocks(blocks: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any, rotary_cos: Any,
                 rotary_sin: Any) -> tuple[Any, Any]:  # fmt: skip
    encoder, hidden = encoder_hidden_states, hidden_states
    for block in blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                image_rotary_emb=(rotary_cos, rotary_sin))  # fmt: skip
    return encoder, hidden


def _flux_first_block(net: Any, **tensors: Any) -> tuple[Any, Any]:
    return _flux_blocks(flux_blocks(net)[:1], **tensors)


def _flux_rest(net: Any, **tensors: Any) -> Any:
    return _flux_blocks(flux_blocks(net)[1:], **tensors)[1]


def _packed_out(net: Any, hidden_states: Any, temb: Any) -> Any:
    """norm_out and proj_out, the packed patches as the transformer returns them (Flux's, Qwen-Image's)."""
    return net.proj_out(net.norm_out(hidden_states, temb))


def flux_blocks(net: Any) -> list[Any]:
    """Flux's blocks in the order its forward runs them: the double-stream ones, then the single-stream ones."""
    return [*net.transformer_blocks, *net.single_transformer_blocks]


# ---- Qwen-Image (QwenImageTransformer2DModel.forward, diffusers 0.42) --------------------------------------------


def _qwen_embed(net: Any, hidden_states: Any, encoder_hidden_states: Any, timestep: Any) -> tuple[Any, ...]:
    hidden = net.img_in(hidden_states)
    temb = net.time_text_embed(timestep.to(hidden.dtype), hidden)
    return hidden, net.txt_in(net.txt_norm(encoder_hidden_states)), temb


def _qwen_blocks(blocks: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any,
                 encoder_hidden_states_mask: Any, img_freqs: Any, txt_freqs: Any) -> tuple[Any, Any]:  # fmt: skip
    """The blocks as the forward calls them, on the graph's (cos, sin) angles (the whole graph's rotary patch) and
    the mask as the forward hands it on, boolean."""
    encoder, hidden = encoder_hidden_states, hidden_states
    mask, rotary = encoder_hidden_states_mask.bool(), (img_freqs, txt_freqs)
    with replaced(rotary_patches()):
        for block in blocks:
            encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb,
                                    encoder_hidden_states_mask=mask, image_rotary_emb=rotary)  # fmt: skip
    return encoder, hidden


def _qwen_first_block(net: Any, **tensors: Any) -> tuple[Any, Any]:
    return _qwen_blocks(net.transformer_blocks[:1], **tensors)


def _qwen_rest(net: Any, **tensors: Any) -> Any:
    """The image stream alone: the last block's text update is dead code, as in the whole graph."""
    return _qwen_blocks(net.transformer_blocks[1:], **tensors)[1]


# ---- FLUX.2 (Flux2Transformer2DModel.forward, diffusers 0.42; no KV cache of reference tokens) ----------------


def _flux2_embed(net: Any, hidden_states: Any, encoder_hidden_states: Any, timestep: Any, img_ids: Any,
                 txt_ids: Any, guidance: Any = None) -> tuple[Any, ...]:  # fmt: skip
    """The tokens, temb, the text-then-image rotary embedding and the three modulations, in the spec's order."""
    import torch

    timestep = timestep.to(hidden_states.dtype) * 1000
    guidance = None if guidance is None else guidance.to(hidden_states.dtype) * 1000
    temb = net.time_guidance_embed(timestep, guidance)
    text_cos, text_sin = net.pos_embed(txt_ids)
    image_cos, image_sin = net.pos_embed(img_ids)
    cos, sin = torch.cat([text_cos, image_cos], dim=0), torch.cat([text_sin, image_sin], dim=0)
    modulations = (net.double_stream_modulation_img(temb), net.double_stream_modulation_txt(temb),
                   net.single_stream_modulation(temb))  # fmt: skip
    hidden, encoder = net.x_embedder(hidden_states), net.context_embedder(encoder_hidden_states)
    return hidden, encoder, temb, cos, sin, *modulations


def _flux2_blocks(net: Any, first: bool, hidden_states: Any, encoder_hidden_states: Any, rotary_cos: Any,
                  rotary_sin: Any, **modulations: Any) -> tuple[Any, Any]:  # fmt: skip
    """The first double-stream block, or every other block: the double-stream ones, then, on the joined stream, the
    single-stream ones; (text, image) tokens out, as a double-stream block returns them."""
    import torch

    encoder, hidden, rotary = encoder_hidden_states, hidden_states, (rotary_cos, rotary_sin)
    doubles = net.transformer_blocks[:1] if first else net.transformer_blocks[1:]
    img, txt = (modulations.get(name) for name in FLUX2_DOUBLE_MODULATIONS)
    for block in doubles:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb_mod_img=img,
                                temb_mod_txt=txt, image_rotary_emb=rotary)  # fmt: skip
    if first or not len(net.single_transformer_blocks):
        return encoder, hidden
    text_tokens = encoder.shape[1]
    joined = torch.cat([encoder, hidden], dim=1)
    for block in net.single_transformer_blocks:
        joined = block(hidden_states=joined, encoder_hidden_states=None,
                       temb_mod=modulations[FLUX2_SINGLE_MODULATION], image_rotary_emb=rotary)  # fmt: skip
    return joined[:, :text_tokens], joined[:, text_tokens:]


def _flux2_first_block(net: Any, **tensors: Any) -> tuple[Any, Any]:
    return _flux2_blocks(net, True, **tensors)


def _flux2_rest(net: Any, **tensors: Any) -> Any:
    return _flux2_blocks(net, False, **tensors)[1]


# ---- SD3 / SD3.5 (SD3Transformer2DModel.forward, diffusers 0.42) -------------------------------------------------


def _sd3_embed(net: Any, hidden_states: Any, timestep: Any, encoder_hidden_states: Any,
               pooled_projections: Any) -> tuple[Any, ...]:  # fmt: skip
    hidden = net.pos_embed(hidden_states).contiguous()
    temb = net.time_text_embed(timestep, pooled_projections)
    return hidden, net.context_embedder(encoder_hidden_states), temb


def _sd3_blocks(blocks: Any, hidden_states: Any, encoder_hidden_states: Any, temb: Any) -> tuple[Any, Any]:
    encoder, hidden = encoder_hidden_states, hidden_states
    for block in blocks:
        encoder, hidden = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb)
    return encoder, hidden


def _sd3_first_block(net: Any, **tensors: Any) -> tuple[Any, Any]:
    return _sd3_blocks(net.transformer_blocks[:1], **tensors)


def _sd3_rest(net: Any, **tensors: Any) -> Any:
    return _sd3_blocks(net.transformer_blocks[1:], **tensors)[1]


def _sd3_out(net: Any, hidden_states: Any, temb: Any, latents: Any) -> Any:
    """norm_out, proj_out, and the patches back into a latent image (``latents``: only its height and width)."""
    import torch

    hidden = net.proj_out(net.norm_out(hidden_states, temb))
    p, channels = net.config.patch_size, net.out_channels
    height, width = latents.shape[-2] // p, latents.shape[-1] // p
    hidden = hidden.reshape(hidden.shape[0], height, width, p, p, channels)
    hidden = torch.einsum("nhwpqc->nchpwq", hidden)
    return hidden.reshape(hidden.shape[0], channels, height * p, width * p)


Part = Callable[..., Any]
FLUX_PARTS: dict[str, Part] = {"transformer_embed": _flux_embed, "transformer_first_block": _flux_first_block,
                               "transformer_rest": _flux_rest, "transformer_out": _packed_out}  # fmt: skip
SD3_PARTS: dict[str, Part] = {"transformer_embed": _sd3_embed, "transformer_first_block": _sd3_first_block,
                              "transformer_rest": _sd3_rest, "transformer_out": _sd3_out}  # fmt: skip
QWEN_PARTS: dict[str, Part] = {"transformer_embed": _qwen_embed, "transformer_first_block": _qwen_first_block,
                               "transformer_rest": _qwen_rest, "transformer_out": _packed_out}  # fmt: skip
FLUX2_PARTS: dict[str, Part] = {"transformer_embed": _flux2_embed, "transformer_first_block": _flux2_first_block,
                                "transformer_rest": _flux2_rest, "transformer_out": _packed_out}  # fmt: skip
KIND_PARTS: dict[str, dict[str, Part]] = {"FluxTransformer2DModel": FLUX_PARTS, "SD3Transformer2DModel": SD3_PARTS,
                                          "QwenImageTransformer2DModel": QWEN_PARTS,
                                          "Flux2Transformer2DModel": FLUX2_PARTS}  # fmt: skip
