"""Preset pieces for a Qwen LLM text encoder (FLUX.2 [klein]'s Qwen3, Qwen-Image's Qwen2.5-VL): an offline
Qwen2-style tokenizer, their configs.

Byte-level BPE over the 256 byte stand-ins (every text tokenizes), Qwen's special tokens, and a chat template in
Qwen3's form: the pipeline applies it (``apply_chat_template(..., enable_thinking=False)``) before tokenizing, so the
preset must carry one. Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

from .byte_level import bytes_to_unicode

# Qwen3's chat markup: a turn per message, then the assistant's turn, its thinking left empty when thinking is off.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen2.5-VL's vision tokens, which a prompt with an image holds (Qwen-Image-Edit's: the image's tokens in between).
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
MERGES = (("t", "h"), ("th", "e"), ("a", "n"), ("an", "d"), ("i", "n"), ("o", "n"), ("Ġ", "a"))


def qwen_chat_tokenizer(max_length: int = 512) -> Any:
    """A Qwen2TokenizerFast: byte-level vocabulary, a few merges, Qwen's special tokens and a Qwen3 chat template;
    it pads with <|endoftext|> on the right and ends a turn with <|im_end|> (its eos), as Qwen3's."""
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]  # lazily exported

    tokens = bytes_to_unicode() + ["".join(m) for m in MERGES]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS[:1], *tokens])}
    tokenizer = Qwen2TokenizerFast(vocab=vocab, merges=list(MERGES), model_max_length=max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen_vl_tokenizer() -> Any:
    """``qwen_chat_tokenizer`` with Qwen2.5-VL's vision tokens (the processor counts ``<|video_pad|>`` ids too)."""
    tokenizer = qwen_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)}, replace_extra_special_tokens=False)
    return tokenizer


def qwen3_config(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """A Qwen3Config over ``tokenizer``'s vocabulary (at least), padding and ending as it does."""
    from transformers import Qwen3Config

    text = dict(kwargs)
    return Qwen3Config(
        vocab_size=max(len(tokenizer), text.pop("vocab_size", 0)), pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, **text,
    )  # fmt: skip


def qwen_vl_config(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """A Qwen2_5_VLConfig whose language model reads ``tokenizer``'s vocabulary (at least), padding and ending as it
    does, and its vision tokens where it has them; ``kwargs``: its text_config and vision_config."""
    from transformers import Qwen2_5_VLConfig

    text = dict(kwargs["text_config"])
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id, "bos_token_id": None}
    text |= {"vocab_size": max(len(tokenizer), text.get("vocab_size", 0))} | ids
    vocab = tokenizer.get_vocab()
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id")
    vision = {name: vocab[token] for name, token in zip(names, VISION_TOKENS, strict=True) if token in vocab}
    return Qwen2_5_VLConfig(text_config=text, vision_config=kwargs["vision_config"], **ids, **vision)


def random_latent_statistics(vae: Any) -> None:
    """Random batch-norm statistics for an AutoencoderKLFlux2 (a fresh one has mean 0, variance 1, which would leave
    the pipeline's normalisation of its latents untested)."""
    import torch

    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
