"""The images a request hands a pipeline — input image, mask, control image, Kontext's reference — checked against
what the pipeline takes, before any engine runs.

Light to import (no torch at import time), like request.py, whose GenerateRequest these checks serve.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ..core.errors import RequestError

if TYPE_CHECKING:
    from ..core.families import Task
    from .request import GenerateRequest

# What to say to a control image given to a pipeline that takes none.
CONTROL_FIX = " (a FLUX.1 Canny / Depth model's pipeline takes one, as ControlNet img2img / inpaint pipelines do)"


def check_inputs(request: GenerateRequest, accepts: Collection[str], image_fix: str = "") -> None:
    """RequestError for an input image or mask a pipeline whose ``__call__`` takes ``accepts`` needs and lacks, or
    for one it takes none of (``image_fix`` says what to do then); light: no torch."""
    for name, flag in (("image", "--image"), ("mask_image", "--mask"), ("control_image", "--control-image")):
        if name in accepts and getattr(request, name) is None:
            raise RequestError(f"this model's pipeline needs an input {name.replace('_', ' ')}: pass {flag}")
    for name in ("negative_prompt", "image", "mask_image", "control_image"):
        if getattr(request, name) is not None and name not in accepts:
            fix = {"image": image_fix, "mask_image": image_fix, "control_image": CONTROL_FIX}.get(name, "")
            raise RequestError(f"this model's pipeline takes no {name.replace('_', ' ')}{fix}")


def kontext_kwargs(request: GenerateRequest, height: int, width: int) -> dict[str, Any]:
    """FLUX.1 Kontext's call: the image at the asked size (it would scale it to max_area, 1 MP), and the reference
    resized to that size, not to the ~1 MP resolution of the nearest aspect ratio diffusers picks (_auto_resize):
    the engine's profile covers as many reference tokens as generated ones."""
    from diffusers.image_processor import VaeImageProcessor

    image = VaeImageProcessor().resize(request.image, height, width) if request.image is not None else None
    return {"max_area": height * width, "_auto_resize": False, "image": image}


def image_size(image: Any) -> tuple[int, int] | None:
    """(height, width) of a PIL image, an HWC array or a CHW / BCHW tensor (a list's first); None for no image."""
    if isinstance(image, list):
        image = image[0] if image else None
    if image is None:
        return None
    if hasattr(image, "getbbox"):  # PIL
        return int(image.height), int(image.width)
    shape = [int(n) for n in image.shape]
    if type(image).__module__.startswith("torch") or len(shape) == 2:  # channels first, or a single channel
        return shape[-2], shape[-1]
    return shape[-3], shape[-2]


def check_pipeline_inputs(request: GenerateRequest, index_class: str, task: Task | None) -> None:
    """``check_inputs`` against the pipeline ``task`` picks in the family of ``index_class`` (the class
    model_index.json names), before diffusers is imported; an image or mask it takes none of is answered with the
    --task whose pipeline takes it."""
    from ..core.families import family_tasks, pipeline_class_name, pipeline_inputs

    wanted: Task = "inpaint" if request.mask_image is not None else "img2img"
    row = family_tasks(index_class)
    if wanted in row:
        fix = f": pass --task {wanted}" + (" and an --image" if request.image is None else "")
    else:
        fix = f" (its family has no {wanted} pipeline; it has {', '.join(row)})" if row else ""
    check_inputs(request, pipeline_inputs(pipeline_class_name(index_class, task)), fix)
