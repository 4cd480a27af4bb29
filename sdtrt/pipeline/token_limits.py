"""How many text tokens a pipeline's encoders run on (``max_sequence_length``), and the prompts refused for more: T5's
(SD3, Flux) and an LLM's (FLUX.2 [klein], Qwen-Image); which of its tokenizers are CLIP's (they cut a prompt at 77)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..core.config import MAX_T5_TOKENS
from ..core.errors import RequestError
from ..core.families import LLM_TOKENS, QWEN_EDIT_VISION_AREA, QWEN_IMAGE_EDIT_PIPELINES, QWEN_PLUS_PICTURE


def clip_tokenizers(pipe: Any) -> dict[str, Any]:
    """Text encoder → tokenizer, for the pipeline's CLIP encoders (SD3's third and Flux's second are T5)."""
    tokenizers = {f"text_encoder{n}": getattr(pipe, f"tokenizer{n}", None) for n in ("", "_2", "_3")}
    return {encoder: t for encoder, t in tokenizers.items() if "CLIP" in type(t).__name__}


# FLUX.2's pipelines pad every prompt to max_sequence_length (their tokenizer call's padding="max_length"): however
# short the prompt, the LLM and the transformer engines read that many tokens.
PADDED_PROMPT_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline")


def t5_kwargs(pipe: Any, prompts: Sequence[str]) -> dict[str, Any]:
    """``max_sequence_length`` for a pipeline with T5 (SD3, Flux): the most tokens its T5 engine's profile takes
    (the pipeline's default on PyTorch). T5 pads every prompt to it; a longer prompt is refused (RequestError),
    never cut as the tokenizer would cut it.
    """
    t5_name = next((n for n in ("text_encoder_3", "text_encoder_2") if _is_t5(getattr(pipe, n, None))), None)
    if t5_name is None:
        return {}
    limit, built = _token_limit(pipe, t5_name)
    check_t5_prompts(prompts, getattr(pipe, t5_name.replace("text_encoder", "tokenizer")), limit, built)
    return {"max_sequence_length": limit}


def llm_kwargs(pipe: Any, prompts: Sequence[str], image: Any = None) -> dict[str, Any]:
    """``max_sequence_length`` for a pipeline whose text encoder is an LLM (FLUX.2 [klein]'s and Z-Image's Qwen3,
    Qwen-Image's Qwen2.5-VL, FLUX.2 [dev]'s Mistral3), as ``t5_kwargs``: a prompt longer than the engines take
    (counted with its chat template, and an Edit pipeline's with the vision tokens of its ``image``, one or a list)
    refused before anything runs. Qwen-Image drops its template's first tokens after the LLM: the LLM reads that many
    more than the transformer."""
    import transformers

    from ..spec import SPECS, LLMEncoderSpec

    llms = tuple(getattr(transformers, s.architecture) for s in SPECS if issubclass(s, LLMEncoderSpec))
    if not isinstance(getattr(pipe, "text_encoder", None), llms):
        return {}
    dropped = getattr(pipe, "prompt_template_encode_start_idx", 0)
    limit, built = _token_limit(pipe, "text_encoder", dropped)
    least = max([1] + [p.tokens.min + extra for p, extra in _token_profiles(pipe, "text_encoder", dropped)])
    if type(pipe).__name__ in PADDED_PROMPT_PIPELINES:  # its engines read max_sequence_length tokens, always
        least = 1
    template = getattr(pipe, "prompt_template_encode", None)
    system = getattr(pipe, "system_message", None)  # Flux2Pipeline's, before each prompt
    images = edit_image_tokens(pipe, image)
    prefix = "".join(QWEN_PLUS_PICTURE.format(n + 1) for n in range(len(images)))
    check_llm_prompts(
        prompts, pipe.tokenizer, limit, built, template, least=least, dropped=dropped, system=system,
        prefix=prefix if type(pipe).__name__ == "QwenImageEditPlusPipeline" else "", images=images,
    )  # fmt: skip
    if type(pipe).__name__ in QWEN_IMAGE_EDIT_PIPELINES:  # it refuses more than 1024 and never cuts the prompt,
        return {"max_sequence_length": min(limit - dropped, LLM_TOKENS["qwenimage"])}  # its image's tokens on top
    return {"max_sequence_length": limit - dropped}


def check_t5_prompts(prompts: Sequence[str], tokenizer: Any, limit: int, built: bool) -> None:
    """RequestError for a prompt of more T5 tokens than ``limit``: what the engines were ``built`` for, or the
    pipeline's max_sequence_length. Such a prompt is refused, never cut as the tokenizer would cut it."""
    for prompt in prompts:
        count = len(tokenizer(prompt).input_ids)
        if count > limit:
            where = "the engines were built for" if built else "the pipeline takes (max_sequence_length)"
            rebuild = built and count <= MAX_T5_TOKENS  # no rebuild takes more than the pipelines do
            raise RequestError(
                f"the prompt {prompt[:30]!r}… is {count} T5 tokens, more than the {limit} {where}; shorten it"
                + (
                    f", or rebuild the engines with a --tokens range covering it (sdtrt compile --tokens "
                    f"32:256:{MAX_T5_TOKENS})"
                    if rebuild
                    else ""
                )
            )


def check_llm_prompts(
    prompts: Sequence[str], tokenizer: Any, limit: int, built: bool, template: str | None = None, *, least: int = 1,
    dropped: int = 0, system: str | None = None, prefix: str = "", images: Sequence[int] = (),
) -> None:  # fmt: skip
    """RequestError for a prompt whose chat-templated tokens (what an LLM text encoder reads: FLUX.2's pipelines apply
    the tokenizer's chat template first, [dev]'s after a ``system`` message; Qwen-Image its own ``template``, the Edit
    Plus pipeline's after a ``prefix`` of its images) outnumber ``limit``, which the tokenizer would cut without a
    word, or number fewer than ``least`` (the engines' minimum). ``dropped``: the template's first tokens the pipeline
    drops after the LLM (a --tokens range counts the others). ``images``: each Edit image's vision tokens, which its
    processor writes where the text has one image-pad token."""
    before = [{"role": "system", "content": system}] if system else []
    text_tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's (FLUX.2 [dev]'s PixtralProcessor)
    for prompt in prompts:
        # [dev] (the pipeline with a system message) asks for no generation prompt, klein for one; a chat template
        # writes its own BOS, so the text is counted without the tokenizer's special tokens, as the pipelines do.
        text = template.format(prefix + prompt) if template is not None else tokenizer.apply_chat_template(
            [*before, {"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=not system,
            enable_thinking=False,
        )  # fmt: skip
        count = len(text_tokenizer(text=text, add_special_tokens=template is not None).input_ids)
        count += sum(images) - len(images)
        if least <= count <= limit:
            continue
        where = "the engines were built for" if built else "the pipeline takes"
        longer = count > limit
        side, fix = (f"more than the {limit}", "shorten it") if longer else (f"fewer than the {least}", "lengthen it")
        less = f" ({count - dropped} once the pipeline drops the template's first {dropped})" if dropped else ""
        held = f" and its {' + '.join(map(str, images))} image tokens" if images else ""
        if images:
            side += f" ({least}..{limit})"
            fix += ", pass fewer images" if longer and len(images) > 1 else ""
        raise RequestError(
            f"the prompt {prompt[:30]!r}… is {count} tokens with its chat template{held}{less}, {side} {where}; {fix}"
            + (f", or rebuild the engines with a --tokens range covering {count - dropped}" if built else "")
        )


def edit_image_tokens(pipe: Any, image: Any) -> list[int]:
    """The vision tokens each condition image puts in an Edit pipeline's prompt ([] for other pipelines, or no image):
    the image resized to the pipeline's area at its aspect ratio (QWEN_EDIT_VISION_AREA), then by its processor into
    a grid of patches (transformers' smart_resize, within the processor's min and max pixels), merge² patches a token.
    QwenImageEditPipeline reads one image, the Plus pipeline each of a list."""
    from ..spec.qwen_vision import condition_size, smart_resize
    from .image_inputs import image_size

    area = QWEN_EDIT_VISION_AREA.get(type(pipe).__name__)
    if area is None or image is None:
        return []
    images = image if isinstance(image, list) else [image]
    processor = pipe.processor.image_processor
    patch, merge, size = processor.patch_size, processor.merge_size, processor.size
    counts = []
    for each in images[: None if type(pipe).__name__ == "QwenImageEditPlusPipeline" else 1]:
        if (given := image_size(each)) is None:  # a form image_size cannot read: the LLM engine's check stays
            continue
        width, height = condition_size(area, given[1] / given[0])
        height, width = smart_resize(height, width, patch * merge, size["shortest_edge"], size["longest_edge"])
        counts.append((height // patch) * (width // patch) // merge**2)
    return counts


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
