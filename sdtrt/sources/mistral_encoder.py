"""Preset pieces for FLUX.2 [dev]'s Mistral-Small-3 text encoder: an offline Mistral-style tokenizer and its config.

Byte-level BPE (Mistral's Tekken vocabulary is byte-level too) over the 256 byte stand-ins, Mistral's special tokens,
and a chat template in Mistral-Small-3.1's form (``[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]``) that reads the
content lists Flux2Pipeline's ``format_input`` makes. The real checkpoint's ``tokenizer`` folder is a
PixtralProcessor, which needs torchvision; on text alone the processor only applies its tokenizer's template and
tokenizes, so the preset saves the tokenizer itself. Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

from .byte_level import bytes_to_unicode

SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
    "[IMG_BREAK]", "[IMG_END]",
)  # fmt: skip
MERGES = (("t", "h"), ("th", "e"), ("a", "n"), ("an", "d"), ("i", "n"), ("o", "n"), ("Ġ", "a"))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.content is string %}{% set text = message.content %}{% else %}"
    "{% set text = message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if message.role == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif message.role == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def mistral_chat_tokenizer(max_length: int = 512) -> Any:
    """A fast tokenizer with Mistral's special tokens and chat markup; as Mistral's own, it pads with <pad> on the left
    and puts <s> before a text it tokenizes with special tokens (the chat template writes its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIAL_TOKENS, *bytes_to_unicode(), *("".join(m) for m in MERGES)]
    bpe = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=list(MERGES)))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tokens.index("<s>"))])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=max_length, padding_side="left",
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[4:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def mistral3_config(tokenizer: Any, kwargs: dict[str, Any]) -> Any:
    """A Mistral3Config whose language model reads ``tokenizer``'s vocabulary (at least); ``kwargs``: its
    text_config and vision_config (a vision tower the text path never runs)."""
    from transformers import Mistral3Config

    text = dict(kwargs["text_config"], model_type="mistral")
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
           "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
    text |= {"vocab_size": max(len(tokenizer), text.get("vocab_size", 0))} | ids
    vision = dict(kwargs["vision_config"], model_type="pixtral")
    image_token = tokenizer.convert_tokens_to_ids("[IMG]")
    return Mistral3Config(text_config=text, vision_config=vision, image_token_index=image_token)
