"""EngineQwenImageVAE: what Qwen-Image's pipelines call instead of AutoencoderKLQwenImage.

A video VAE run on single frames: the pipelines pass latents ``[B, C, 1, h, w]`` and images ``[B, 3, 1, H, W]``.
Its engines are its ``encode`` / ``decode`` at one frame with the frame axis taken out (spec/vae.py), so the
stand-in takes the axis out, runs the engine and puts it back; its causal convolutions' frame caches are Python
state of the PyTorch forward, reset on every call, and none of them is in a graph. More frames than one (a video),
tiling and slicing are refused in one line. The pipelines apply ``latents_mean`` / ``latents_std`` themselves, from
``config``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKLOutput
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution

from ..core.errors import EngineInputError
from ..runtime import Runtime
from .base import EngineModule


class EngineQwenImageVAE(EngineModule, AutoencoderKLQwenImage):
    """An AutoencoderKLQwenImage stand-in on single frames; a half the set lacks runs on the PyTorch VAE."""

    def __init__(
        self, config: dict[str, Any], decoder: Runtime | None, encoder: Runtime | None,
        pytorch: Callable[[], Any], dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype, [decoder, encoder])
        self.decoder_runtime, self.encoder_runtime = decoder, encoder
        self._pytorch = pytorch
        self._loaded: Any = None
        self.temperal_downsample = list(config["temperal_downsample"])  # the pipelines' scale factor reads it
        self.use_slicing = self.use_tiling = False

    def _run(self, runtime: Runtime | None, x: torch.Tensor, call: str) -> torch.Tensor:
        """One frame through the half's engine (its PyTorch half where the set has no engine for it)."""
        if x.ndim != 5 or x.shape[2] != 1:
            raise EngineInputError(
                f"{type(self).__name__}.{call} takes one frame ([B, C, 1, H, W]), not {tuple(x.shape)}: its engines "
                "were built for images; run videos on PyTorch (load_pipeline without an engine)"
            )
        if self.use_tiling or self.use_slicing:
            raise EngineInputError(
                f"{type(self).__name__}.{call}: tiling and slicing are not built for Qwen-Image's VAE engines; "
                "call disable_tiling() / disable_slicing()"
            )
        if runtime is None:
            if self._loaded is None:
                self._loaded = self._pytorch()
            vae = self._loaded.to(x.device, x.dtype)
            out = vae.decode(x).sample if call == "decode" else vae.encode(x).latent_dist.parameters
            return out
        spec = runtime.spec
        out = runtime.run({spec.input_names[0]: x[:, :, 0]})[spec.output_names[0]]
        return out.to(x.device, x.dtype).unsqueeze(2)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        posterior = DiagonalGaussianDistribution(self._run(self.encoder_runtime, x, "encode"))
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def decode(self, z: torch.Tensor, return_dict: bool = True, **kwargs: Any) -> Any:
        sample = self._run(self.decoder_runtime, z, "decode")
        return DecoderOutput(sample=sample) if return_dict else (sample,)
