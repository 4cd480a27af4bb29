"""How close two images are, as the field reports it: PSNR in dB and SSIM (Wang et al. 2004)."""

from __future__ import annotations

import math

import numpy as np


def psnr_db(candidate: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of images in [0, 1]; inf when they are equal."""
    mse = float(np.mean((candidate.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(candidate: np.ndarray, reference: np.ndarray) -> float:
    """Mean structural similarity of images in [0, 1] (``[..., H, W, C]``): an 11-tap Gaussian window of σ 1.5 per
    channel and the paper's constants K1 = 0.01, K2 = 0.03, averaged over pixels, channels and images."""
    from scipy.ndimage import gaussian_filter

    a = np.asarray(candidate, dtype=np.float64).reshape(-1, *candidate.shape[-3:])
    b = np.asarray(reference, dtype=np.float64).reshape(-1, *reference.shape[-3:])
    c1, c2 = 0.01**2, 0.03**2
    scores = []
    for x, y in zip(a, b, strict=True):
        for channel in range(x.shape[-1]):
            xc, yc = x[..., channel], y[..., channel]

            def blur(image: np.ndarray) -> np.ndarray:
                return gaussian_filter(image, sigma=1.5, truncate=3.5)  # 3.5 σ each side: 11 taps

            mx, my = blur(xc), blur(yc)
            vx, vy, cov = blur(xc * xc) - mx * mx, blur(yc * yc) - my * my, blur(xc * yc) - mx * my
            scores.append(((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2)))
    return float(np.mean(scores))
