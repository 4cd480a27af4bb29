"""EngineFlux2VAE: what FLUX.2's pipelines call instead of AutoencoderKLFlux2.

Its encoder and decoder are engines as AutoencoderKL's are (EngineHalves); the pipelines also read ``vae.bn``, the
batch-norm statistics of the patchified latents (running mean and variance, ``config.batch_norm_eps``), which they
apply themselves around the transformer: the stand-in carries that module, read alone from the VAE's weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLFlux2

from ..core.errors import ArtifactError
from .vae import EngineHalves

STATISTICS = ("running_mean", "running_var")  # all the pipelines read (not num_batches_tracked)


class EngineFlux2VAE(EngineHalves, AutoencoderKLFlux2):
    """An AutoencoderKLFlux2 stand-in: EngineHalves, plus the latents' batch norm ``bn`` the pipelines read."""

    def __init__(self, config: dict[str, Any], *args: Any, latent_norm: torch.nn.BatchNorm2d, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.bn = latent_norm


def latent_batch_norm(folder: Path, config: dict[str, Any]) -> torch.nn.BatchNorm2d:
    """AutoencoderKLFlux2's ``bn`` with the statistics its safetensors files hold (nothing else is read)."""
    from safetensors import safe_open

    channels = math.prod(config.get("patch_size", (2, 2))) * config["latent_channels"]
    norm = torch.nn.BatchNorm2d(channels, eps=config.get("batch_norm_eps", 1e-4), affine=False)
    wanted = {f"bn.{name}": name for name in STATISTICS}
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            found |= {wanted[key]: weights.get_tensor(key) for key in wanted.keys() & set(weights.keys())}
    if missing := [name for name in STATISTICS if name not in found]:
        raise ArtifactError(
            f"the VAE weights in {folder} lack bn.{', bn.'.join(missing)}, the latent statistics FLUX.2's pipelines "
            "read: re-download or re-save the VAE"
        )
    for name in STATISTICS:
        getattr(norm, name).copy_(found[name].float())
    return norm.eval()
