"""Qwen-Image-Edit's processor (``processor/``: transformers' Qwen2VLProcessor, the tokenizer and the image processor
that cuts the condition image into patches) where transformers cannot make one: without torchvision its
ProcessorMixin refuses any Qwen2VLProcessor (it looks up the video processor's class, which needs torchvision), though
the Edit pipelines pass it images alone. ``ImageQwen2VLProcessor`` is that processor without the video half; it
loads the same folder, and the slow ``Qwen2VLImageProcessor`` (a PIL one) cuts the images. What it saves names
``Qwen2VLProcessor`` and its video processor, as the checkpoints' folders do, so that stock transformers (with
torchvision) loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

from ..core.families import QWEN_IMAGE_EDIT_PIPELINES

# The tiny preset's condition image (~1024² before the processor) at most 112² pixels after it: 64 patches, 16 tokens.
TINY_PIXELS = (56 * 56, 112 * 112)


class ImageQwen2VLProcessor(Qwen2VLProcessor):
    """A Qwen2VLProcessor for images and text only: no video processor (transformers' needs torchvision). What it
    saves is the stock processor's: ProcessorMixin writes the class's own name as processor_class, and transformers
    has no ImageQwen2VLProcessor to load."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        # processor_config.json as the checkpoints' (their model_index.json names Qwen2VLProcessor): the stock class,
        # and the video processor stock loading looks up (OSError "Can't load video processor" without it).
        return super().to_dict() | {"processor_class": STOCK, "video_processor": {"video_processor_type": STOCK_VIDEO}}

    def save_pretrained(self, save_directory: Any, push_to_hub: bool = False, **kwargs: Any) -> Any:
        saved = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        # ProcessorMixin.save_pretrained has the tokenizer write this class's name too (tokenizer_config.json).
        config = Path(save_directory) / "tokenizer_config.json"
        config.write_text(json.dumps(json.loads(config.read_text()) | {"processor_class": STOCK}, indent=2) + "\n")
        return saved


STOCK, STOCK_VIDEO = Qwen2VLProcessor.__name__, "Qwen2VLVideoProcessor"


def new_edit_processor(tokenizer: Any, pixels: tuple[int, int]) -> ImageQwen2VLProcessor:
    """A processor of ``tokenizer`` (with Qwen2.5-VL's vision tokens) resizing its images to (min, max) ``pixels``."""
    images = Qwen2VLImageProcessor(min_pixels=pixels[0], max_pixels=pixels[1])
    return ImageQwen2VLProcessor(image_processor=images, tokenizer=tokenizer)


def edit_processor(pipeline_class: str, model_folder: Path) -> dict[str, Any]:
    """``{"processor": …}`` from the folder's ``processor/`` for an Edit pipeline's ``from_pretrained``, {} for the
    other pipelines."""
    if pipeline_class not in QWEN_IMAGE_EDIT_PIPELINES:
        return {}
    return {"processor": ImageQwen2VLProcessor.from_pretrained(model_folder / "processor")}
