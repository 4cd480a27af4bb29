"""The images of a validation for the HTML report: kept as PNGs beside a stored report, embedded as data URIs, and
the |difference| between the engine's image and PyTorch's as a heat map with its scale."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_FILES = {"pytorch": "pytorch.png", "engine": "engine.png"}  # a stored validation's images, beside its JSON
HEAT_COLORMAP = "magma"  # perceptually uniform, dark for no difference, readable in grey when printed
NON_FINITE_COLOR = (0, 255, 255)  # cyan, outside magma: a pixel that is NaN/inf in the engine's image


def to_uint8(image: np.ndarray) -> np.ndarray:
    """An image in [0, 1] as 8-bit pixels; NaN/inf pixels (a broken engine's) are black."""
    return (np.clip(np.nan_to_num(image, nan=0.0, posinf=0.0, neginf=0.0), 0, 1) * 255).round().astype(np.uint8)


def save_images(images: dict[str, np.ndarray], folder: Path) -> None:
    """Each image as a PNG, and where it has NaN/inf pixels (which a PNG cannot hold) their mask beside it, so the
    stored page still shows them."""
    for name, image in images.items():
        _pil(to_uint8(image)).save(folder / IMAGE_FILES[name])
        non_finite = ~np.isfinite(image).all(axis=-1)
        if non_finite.any():
            _pil(non_finite).save(folder / _mask_file(name))


def load_images(folder: Path) -> dict[str, np.ndarray]:
    """The images saved beside a stored report, in [0, 1], NaN where they were not finite ({} for a report stored
    without them)."""
    from PIL import Image

    images = {}
    for name, file in IMAGE_FILES.items():
        if not (folder / file).is_file():
            continue
        with Image.open(folder / file) as png:
            image = np.asarray(png.convert("RGB"), dtype=np.float64) / 255
        if (folder / _mask_file(name)).is_file():
            with Image.open(folder / _mask_file(name)) as mask:
                image[np.asarray(mask.convert("1"), dtype=bool)] = np.nan
        images[name] = image
    return images


def _mask_file(name: str) -> str:
    return f"{name}.nonfinite.png"


def png_data_uri(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    _pil(pixels).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def difference_map(image: np.ndarray, reference: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The per-pixel |image − reference| (largest over the channels) coloured from 0 to its own maximum, that
    maximum (the scale a reader needs, as a tiny difference would otherwise look as loud as a broken image) and the
    share of pixels that are NaN/inf."""
    difference = np.abs(image.astype(np.float64) - reference.astype(np.float64)).max(axis=-1)
    finite = np.isfinite(difference)
    scale = float(difference[finite].max(initial=0.0))
    colors = heat_colors(np.where(finite, difference, 0.0) / (scale or 1.0))
    colors[~finite] = NON_FINITE_COLOR
    return colors, scale, float(1 - finite.mean())


def heat_colors(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] as the colormap's 8-bit RGB."""
    from matplotlib import colormaps

    return (colormaps[HEAT_COLORMAP](np.clip(values, 0, 1))[..., :3] * 255).round().astype(np.uint8)


def _pil(pixels: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(pixels)
