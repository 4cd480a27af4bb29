"""An LLM text encoder (Qwen3ForCausalLM, a bare Qwen3Model, Qwen2.5-VL's language model) as the graph exports it:
its decoder stack alone (no logits), the pipeline's hidden-state layers stacked, and the attention mask built in the
graph from the padding mask."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..spec import LLMEncoderSpec

if TYPE_CHECKING:
    import torch


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[B, 1, T, T]`` mask transformers builds for a right-padded batch: query q sees key k ≤ q where
    k is a token, not padding. A row that would see nothing (a mask padded at its start) sees its own position
    instead: softmax over nothing but the dtype's minimum is NaN in fp16 and a guess in fp32, never a number to
    trust. Qwen's tokenizer pads on the right, where no row is empty; Mistral's on the left, where this equals
    transformers' output bit for bit, the pad rows' included. Row q is empty where the mask's running sum is 0 at q:
    a CumSum, not a reduction over the [B, 1, T, T] mask, which ONNX Runtime's symbolic shape inference
    (check-blocks') cannot size at opset 18 (ReduceMax with its axes as an input)."""
    import torch

    count = attention_mask.shape[1]
    positions = torch.arange(count, device=attention_mask.device)
    causal = positions[None, :] <= positions[:, None]
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    own = (positions[None, :] == positions[:, None])[None, None]
    sees_nothing = (attention_mask.cumsum(dim=-1) == 0)[:, None, :, None]
    allowed = allowed | (own & sees_nothing)
    minimum = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(~allowed, minimum)


def llm_call(network: Any, spec: LLMEncoderSpec) -> Callable[..., torch.Tensor]:
    """The graph's forward: (input_ids, attention_mask) → the ``spec.hidden_layers`` hidden states, stacked on axis 1.

    The decoder stack (a causal LM's ``network.model``, a Qwen3Model itself; Qwen2.5-VL's and Mistral3's, on text
    alone, never reach their vision towers) runs without the LM head, which the pipeline never reads; the mask goes
    in prepared (transformers' mask mapping, or one mask where ``spec.mask_mapping`` is off), so the graph holds one
    explicit mask instead of transformers' mask helpers (which branch on the inputs' values)."""
    import torch

    decoder = getattr(network, "model", network)

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, *image_embeds: torch.Tensor) -> torch.Tensor:
        dtype = network.get_input_embeddings().weight.dtype
        prepared = causal_padding_mask(attention_mask, dtype)
        mask = {"full_attention": prepared} if spec.mask_mapping else prepared
        # A prompt with an image (QwenVLImageEncoderSpec): its embeddings in place of the image tokens'.
        tokens = {"inputs_embeds": with_images(network, input_ids, image_embeds[0], spec)} if image_embeds else {}
        tokens = tokens or {"input_ids": input_ids}
        out = decoder(**tokens, attention_mask=mask, output_hidden_states=True, use_cache=False)
        return torch.stack([out.hidden_states[k] for k in spec.hidden_layers], dim=1)

    return forward


def with_images(network: Any, input_ids: torch.Tensor, image_embeds: torch.Tensor, spec: Any) -> torch.Tensor:
    """The prompt's token embeddings, the image tokens' replaced by ``image_embeds`` row after row in the batch's
    reading order (transformers' masked_scatter): each image token takes the row its running count names, a
    gather a graph can hold."""
    import torch

    embeds = network.get_input_embeddings()(input_ids)
    is_image = input_ids == spec.image_token_id
    rows = (is_image.flatten().long().cumsum(0) - 1).clamp(min=0).reshape(input_ids.shape)  # ONNX: no bool CumSum
    return torch.where(is_image[..., None], image_embeds.to(embeds.dtype)[rows], embeds)


def llm_reference(network: Any, spec: LLMEncoderSpec) -> Callable[..., torch.Tensor]:
    """What validation holds the graph to: the whole network as transformers runs it (its own causal and padding
    masks from the ``[B, T]`` padding mask), the same layers stacked."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, *image_embeds: torch.Tensor) -> torch.Tensor:
        # The images' embeddings go in as get_image_features gives them (Qwen2.5-VL's mm_encoder_outputs): a tuple.
        tower = BaseModelOutputWithPooling(pooler_output=image_embeds)  # type: ignore[arg-type]
        images = {"mm_encoder_outputs": {"image": tower}}
        out = network(
            input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False,
            **(images if image_embeds else {}),
        )  # fmt: skip
        return torch.stack([out.hidden_states[k] for k in spec.hidden_layers], dim=1)

    return forward
