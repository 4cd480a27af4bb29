"""How many text tokens a pipeline's encoders run on (``max_sequence_length``), and the prompts refused for more: T5's
(SD3, Flux) and an LLM's (FLUX.2 [klein], Qwen-Image); which of its tokenizers are CLIP's (they cut a prompt at 77)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..core.families import LLM_TOKENS, QWEN_IMAGE_EDIT_PIPELINES


def clip_tokenizers(pipe: Any) -> dict[str, Any]:
    """Text encoder → tokenizer, for the pipeline's CLIP encoders (SD3's third and Flux's second are T5)."""
    tokenizers = {f"text_encoder{n}": getattr(pipe, f"tokenizer{n}", None) for n in ("", "_2", "_3")}
    return {encoder: t for encoder, t in tokenizers.items() if "CLIP" in type(t).__name__}


def t5_kwargs(pipe: Any, prompts: Sequence[str]) -> dict[str, Any]:
    """``max_sequence_length`` for a pipeline with T5 (SD3, Flux): the most tokens its T5 engine's profile takes
    (the pipeline's default on PyTorch). T5 pads every prompt to it; a longer prompt is refused (RequestError),
    never cut as the tokenizer would cut it.
    """
    t5_name = next((n for n in ("text_encoder_3", "text_encoder_2") if _is_t5(getattr(pipe, n, None))), None)
    if t5_name is None:
        return {}
    from .request import check_t5_prompts  # shared with the CLI's check before loading

    limit, built = _token_limit(pipe, t5_name)
    check_t5_prompts(prompts, getattr(pipe, t5_name.replace("text_encoder", "tokenizer")), limit, built)
    return {"max_sequence_length": limit}


def llm_kwargs(pipe: Any, prompts: Sequence[str]) -> dict[str, Any]:
    """``max_sequence_length`` for a pipeline whose text encoder is an LLM (FLUX.2 [klein]'s and Z-Image's Qwen3,
    Qwen-Image's Qwen2.5-VL, FLUX.2 [dev]'s Mistral3), as ``t5_kwargs``: a prompt longer than the engines take
    (counted with its chat template) refused before anything runs. Qwen-Image drops its template's first tokens
    after the LLM: the LLM reads that many more than the transformer."""
    import transformers

    from ..spec import SPECS, LLMEncoderSpec

    llms = tuple(getattr(transformers, s.architecture) for s in SPECS if issubclass(s, LLMEncoderSpec))
    if not isinstance(getattr(pipe, "text_encoder", None), llms):
        return {}
    from .request import check_llm_prompts

    dropped = getattr(pipe, "prompt_template_encode_start_idx", 0)
    limit, built = _token_limit(pipe, "text_encoder", dropped)
    least = max([1] + [p.tokens.min + extra for p, extra in _token_profiles(pipe, "text_encoder", dropped)])
    template = getattr(pipe, "prompt_template_encode", None)
    system = getattr(pipe, "system_message", None)  # Flux2Pipeline's, before each prompt
    check_llm_prompts(prompts, pipe.tokenizer, limit, built, template, least=least, dropped=dropped, system=system)
    if type(pipe).__name__ in QWEN_IMAGE_EDIT_PIPELINES:  # it refuses more than 1024 and never cuts the prompt,
        return {"max_sequence_length": min(limit - dropped, LLM_TOKENS["qwenimage"])}  # its image's tokens on top
    return {"max_sequence_length": limit - dropped}


def _token_limit(pipe: Any, encoder: str, dropped: int = 0) -> tuple[int, bool]:
    """The most text tokens the ``encoder``'s and the transformer's engine profiles take (the transformer's plus the
    ``dropped`` tokens the pipeline reads from the encoder and drops), and True; or the pipeline's
    max_sequence_length default (plus ``dropped``) and False where neither is an engine."""
    limit = inspect.signature(pipe.__call__).parameters["max_sequence_length"].default + dropped
    built = [profile.tokens.max + extra for profile, extra in _token_profiles(pipe, encoder, dropped)]
    return (min(built), True) if built else (limit, False)


def _token_profiles(pipe: Any, encoder: str, dropped: int) -> list[tuple[Any, int]]:
    """The engine profiles with a token axis of the ``encoder`` and the transformer, each with the tokens to add to
    its count for the encoder's (the transformer reads ``dropped`` fewer)."""
    found = []
    for name, extra in ((encoder, 0), ("transformer", dropped)):
        profile = getattr(getattr(getattr(pipe, name), "runtime", None), "profile", None)
        if profile is not None and profile.tokens is not None:
            found.append((profile, extra))
    return found


def _is_t5(module: Any) -> bool:
    from transformers import T5EncoderModel

    return isinstance(module, T5EncoderModel)
