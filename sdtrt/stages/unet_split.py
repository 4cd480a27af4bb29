"""A UNet cut where DeepCache needs it: the deep pass (the whole UNet, handing out the feature at the cut) and the
shallow branch (the UNet's outer layers around the cut, the kept feature in).

Both are composed of the diffusers network's own submodules (its embeddings, conv_in, blocks, their resnets and
transformers, conv_out), called as UNet2DConditionModel.forward and its blocks' forwards call them (diffusers 0.42),
so the deep pass computes the whole forward, and the shallow branch what the ``deepcache`` package's skip steps
compute: ``tests/test_deepcache.py`` checks both, bit for bit, at every branch.

Where the cut is (spec/unet_split.py): before layer ``first`` of up block ``up``. On the shallow side run the down
blocks before the cut's mirror, that block's first ``kept - 1`` layers (the skip features the kept up layers read),
the up block's layers from ``first`` on, and every later up block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..spec.unet_split import DEEP_FEATURE, Branch, UNetPartSpec

if TYPE_CHECKING:
    import torch

Tensors = tuple[Any, ...]


@dataclass(frozen=True)
class Cut:
    """A branch on this network: up block ``up`` (forward order) is cut before its layer ``first``; its mirror is
    down block ``down``; the shallow branch runs the up block's last ``kept`` layers."""

    up: int
    down: int
    first: int
    kept: int

    @classmethod
    def of(cls, network: Any, branch_id: int) -> Cut:
        branch = Branch.of(branch_id)
        up = len(network.up_blocks) - 1 - branch.block
        layers = len(network.up_blocks[up].resnets)
        kept = min(branch.layer + 1, layers)
        return cls(up=up, down=branch.block, first=layers - kept, kept=kept)


def part_module(spec: UNetPartSpec, network: Any) -> Callable[..., Any]:
    """The callable an exporter traces for one member: positional tensors in, tensors out, in the spec's order."""
    cut = Cut.of(network, spec.cache_branch_id)

    def call(*inputs: torch.Tensor) -> Any:
        given = dict(zip(spec.canonical_inputs, inputs, strict=True))
        if DEEP_FEATURE in given:
            return shallow_branch(network, cut, given.pop(DEEP_FEATURE), **given)
        return deep_pass(network, cut, **given)

    return call


def deep_pass(network: Any, cut: Cut, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole UNet: its output, and the feature that enters the cut from below."""
    emb, text, sample = _embed(network, **inputs)
    skips: Tensors = (sample,)
    for block in network.down_blocks:
        sample, more = _down_block(block, sample, emb, text)
        skips += more
    if network.mid_block is not None:
        mid = network.mid_block
        cross = {"encoder_hidden_states": text} if getattr(mid, "has_cross_attention", False) else {}
        sample = mid(sample, emb, **cross)
    resize = _resizes(network, inputs["sample"])
    for i, block in enumerate(network.up_blocks[: cut.up]):
        block_skips, skips = skips[-len(block.resnets) :], skips[: -len(block.resnets)]
        sample = _up_block(block, sample, block_skips, emb, text, resize(skips, i))
    block = network.up_blocks[cut.up]
    feature = _up_layers(block, range(cut.first), sample, skips, emb, text)
    # What the up block's layers before the cut read; the rest stays for the layers from the cut on.
    skips = skips[: len(skips) - cut.first]
    return _from_cut(network, cut, feature, skips, emb, text, resize), feature


def shallow_branch(network: Any, cut: Cut, feature: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    """The UNet's output on a step that reuses ``feature`` (the deep pass's, from an earlier step)."""
    emb, text, sample = _embed(network, **inputs)
    skips: Tensors = (sample,)
    for block in network.down_blocks[: cut.down]:
        sample, more = _down_block(block, sample, emb, text)
        skips += more
    block = network.down_blocks[cut.down]
    for i in range(cut.kept - 1):
        sample = _layer(block, i, sample, emb, text)
        skips += (sample,)
    return _from_cut(network, cut, feature, skips, emb, text, _resizes(network, inputs["sample"]))


def _embed(
    network: Any, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
    text_embeds: torch.Tensor | None = None, time_ids: torch.Tensor | None = None,
    timestep_cond: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The time embedding (SDXL's added conditioning, LCM's guidance in), the text as the blocks take it and conv_in's
    output: what the forward computes before its down blocks, for the inputs a UNet graph takes (a shallow branch
    without cross-attention takes no text)."""
    added = None if text_embeds is None else {"text_embeds": text_embeds, "time_ids": time_ids}
    if network.config.center_input_sample:
        sample = 2 * sample - 1.0
    emb = network.time_embedding(network.get_time_embed(sample=sample, timestep=timestep), timestep_cond)
    aug = network.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added)
    emb = emb + aug if aug is not None else emb
    if network.time_embed_act is not None:
        emb = network.time_embed_act(emb)
    text = network.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added)
    return emb, text, network.conv_in(sample)


def _from_cut(
    network: Any, cut: Cut, feature: torch.Tensor, skips: Tensors, emb: torch.Tensor, text: torch.Tensor,
    resize: Callable[[Tensors, int], Any],
) -> torch.Tensor:  # fmt: skip
    """From the cut to the output: the cut block's kept layers and upsampler, the later up blocks, conv_out."""
    block = network.up_blocks[cut.up]
    block_skips, skips = skips[-cut.kept :], skips[: -cut.kept]
    sample = _up_layers(block, range(cut.first, len(block.resnets)), feature, block_skips, emb, text)
    for upsampler in block.upsamplers or ():
        sample = upsampler(sample, resize(skips, cut.up))
    for i, block in enumerate(network.up_blocks[cut.up + 1 :], start=cut.up + 1):
        block_skips, skips = skips[-len(block.resnets) :], skips[: -len(block.resnets)]
        sample = _up_block(block, sample, block_skips, emb, text, resize(skips, i))
    if network.conv_norm_out:
        sample = network.conv_act(network.conv_norm_out(sample))
    return network.conv_out(sample)


def _resizes(network: Any, sample: torch.Tensor) -> Callable[[Tensors, int], Any]:
    """The forward's upsample_size for up block ``i``, given the skip features left: the size of the next one where
    the latents are off the upsamplers' grid, else None (a graph's latents never are: its profile keeps the grid)."""
    factor, last = 2**network.num_upsamplers, len(network.up_blocks) - 1
    off_grid = any(dim % factor for dim in sample.shape[-2:])
    return lambda skips, i: skips[-1].shape[2:] if off_grid and i < last else None


def _down_block(block: Any, sample: torch.Tensor, emb: torch.Tensor, text: torch.Tensor) -> tuple[Any, Tensors]:
    cross = {"encoder_hidden_states": text} if getattr(block, "has_cross_attention", False) else {}
    return block(hidden_states=sample, temb=emb, **cross)


def _up_block(
    block: Any, sample: torch.Tensor, skips: Tensors, emb: torch.Tensor, text: torch.Tensor, size: Any
) -> torch.Tensor:
    cross = {"encoder_hidden_states": text} if getattr(block, "has_cross_attention", False) else {}
    return block(hidden_states=sample, temb=emb, res_hidden_states_tuple=skips, upsample_size=size, **cross)


def _up_layers(
    block: Any, layers: range, sample: torch.Tensor, skips: Tensors, emb: torch.Tensor, text: torch.Tensor
) -> torch.Tensor:
    """Some of an up block's layers, each on the sample and the last skip feature left, as the block's forward
    pops them (no upsampler)."""
    import torch

    for i in layers:
        sample = _layer(block, i, torch.cat([sample, skips[-1]], dim=1), emb, text)
        skips = skips[:-1]
    return sample


def _layer(block: Any, i: int, sample: torch.Tensor, emb: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """A block's layer ``i``: its resnet, then its transformer where the block has them (CrossAttn…Block2D)."""
    sample = block.resnets[i](sample, emb)
    if getattr(block, "attentions", None):
        sample = block.attentions[i](sample, encoder_hidden_states=text, return_dict=False)[0]
    return sample
