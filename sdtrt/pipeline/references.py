"""Reference images (FLUX.2 [klein]'s editing inputs) checked against the engines' profile before anything runs: each
adds its patches to the transformer's and runs through the VAE encoder at the size the pipeline feeds it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.config import ShapeProfile
from ..core.errors import RequestError

# Flux2KleinPipeline scales a reference over this many pixels down to it (its aspect kept), then crops it to its grid.
REFERENCE_AREA = 1024 * 1024


def reference_list(image: Any) -> list[Any]:
    """A request's ``image`` as the pipeline reads it for references: none, one, or a list."""
    if image is None:
        return []
    return list(image) if isinstance(image, list | tuple) else [image]


def request_references(image: Any, image_reference: Any) -> list[Any]:
    """The reference images a FLUX.2 [klein] pipeline encodes for a request: its ``image`` (the txt2img pipeline's
    references, or the inpainting one's image to repaint, a reference there too) and its ``image_reference``."""
    return reference_list(image) + reference_list(image_reference)


def fed_size(image: Any, multiple: int) -> tuple[int, int]:
    """(height, width) in pixels the pipeline encodes a PIL reference ``image`` at: scaled down to REFERENCE_AREA
    when larger, then cut to a ``multiple`` (the VAE's scale factor times its 2×2 patches)."""
    width, height = image.size
    if width * height > REFERENCE_AREA:
        scale = (REFERENCE_AREA / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    return height // multiple * multiple, width // multiple * multiple


def check_references(images: Sequence[Any], profile: ShapeProfile | None, multiple: int) -> None:
    """RequestError (one line) when reference ``images`` would leave the engines' ``profile``: more than it counts,
    or one larger or smaller than its height × width range once the pipeline has resized it."""
    if profile is None or not images:
        return
    if problem := profile.references_problem([fed_size(image, multiple) for image in images]):
        raise RequestError(problem)


def check_pipeline_references(pipe: Any, images: Sequence[Any]) -> None:
    """``check_references`` for a loaded pipeline whose transformer is an engine (its profile is the set's)."""
    profile = getattr(getattr(pipe.transformer, "runtime", None), "profile", None)
    check_references(images, profile, pipe.vae_scale_factor * 2)
