"""How close two images are, as the field reports it: PSNR in dB and SSIM (Wang et al. 2004)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def psnr_db(candidate: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of images in [0, 1]; inf when they are equal."""
    mse = float(np.mean((candidate.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def latent_psnr_db(candidate: Any, reference: Any) -> float:
    """PSNR of latents (torch tensors), whose range is no image's [0, 1]: the peak is the reference's largest
    magnitude (the candidate's, where the reference is all zeros); inf when they are equal, nan when the candidate
    holds NaN/inf."""
    a, b = (np.asarray(t.detach().double().cpu()) for t in (candidate, reference))
    mse = float(np.mean((a - b) ** 2))
    peak = float(np.abs(b).max(initial=0.0)) or float(np.abs(a).max(initial=0.0))
    return math.inf if mse == 0 else float("nan") if not math.isfinite(mse) else 10 * math.log10(peak**2 / mse)


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


CLIP_MODEL_ENV = "SDTRT_CLIP_MODEL"  # a local folder with a transformers CLIPModel (openai/clip-vit-large-patch14)


def clip_score(images: np.ndarray, prompt: str, model_dir: str) -> float:
    """CLIP score as torchmetrics defines it: 100 × max(cosine(image embedding, text embedding), 0), averaged over the
    images (``[N, H, W, C]`` in [0, 1]); the CLIP model is read from ``model_dir`` only, never downloaded."""
    import torch
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(model_dir, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(model_dir, local_files_only=True)
    pixels = [np.asarray(image * 255, dtype=np.uint8) for image in np.asarray(images).reshape(-1, *images.shape[-3:])]
    inputs = processor(text=[prompt] * len(pixels), images=pixels, return_tensors="pt", padding=True, truncation=True)
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=inputs["pixel_values"])
        text_features = model.get_text_features(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    # transformers 5 returns the projected embeddings as the outputs' pooler_output; 4.x returned the tensor itself.
    image_features, text_features = (getattr(f, "pooler_output", f) for f in (image_features, text_features))
    cosine = torch.nn.functional.cosine_similarity(image_features, text_features)
    return float((100 * cosine.clamp(min=0)).mean())


def lpips_distance(candidate: np.ndarray, reference: np.ndarray) -> float:
    """LPIPS (AlexNet) between images in [0, 1], with the ``lpips`` package's weights (ImportError without it)."""
    import lpips  # optional (its AlexNet backbone's weights come through torchvision)
    import torch

    def tensor(images: np.ndarray) -> torch.Tensor:
        batch = np.asarray(images, dtype=np.float32).reshape(-1, *images.shape[-3:])
        return torch.from_numpy(batch).permute(0, 3, 1, 2) * 2 - 1  # NCHW in [-1, 1], as lpips takes them

    with torch.no_grad():
        return float(lpips.LPIPS(net="alex", verbose=False)(tensor(candidate), tensor(reference)).mean())


def perceptual_scores(candidate: np.ndarray, reference: np.ndarray, prompt: str) -> dict[str, object]:
    """LPIPS and the CLIP scores of both images where their weights are on this machine; ``not_measured`` says why
    each missing one is (nothing is downloaded: point SDTRT_CLIP_MODEL at a local CLIP folder, install lpips)."""
    import os

    scores: dict[str, object] = {}
    missing: dict[str, str] = {}
    try:
        scores["lpips"] = round(lpips_distance(candidate, reference), 4)
    except Exception as exc:  # not installed, or its backbone's weights not cached: say which
        missing["lpips"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if model_dir := os.environ.get(CLIP_MODEL_ENV):
        scores["clip_score"] = round(clip_score(candidate, prompt, model_dir), 3)
        scores["reference_clip_score"] = round(clip_score(reference, prompt, model_dir), 3)
    else:
        missing["clip_score"] = f"{CLIP_MODEL_ENV} names no local CLIP model folder"
    return scores | ({"not_measured": missing} if missing else {})
