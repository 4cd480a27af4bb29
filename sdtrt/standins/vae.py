"""The VAE stand-in: what a diffusers pipeline calls instead of AutoencoderKL.

Like EngineUNet, it keeps the module's call signature, ``config``, ``dtype``, ``device`` and output
classes, and refuses what its engine cannot do instead of silently doing something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import AutoencoderKL

from ..core.config import pixel_size
from ..core.progress import console
from ..runtime import Runtime
from .base import EngineModule


class EngineHalf(torch.nn.Module):
    """One half of a VAE on an engine (encoder + quant conv, or post-quant conv + decoder, as exported)."""

    def __init__(self, runtime: Runtime, fallback: PyTorchHalf) -> None:
        super().__init__()
        self.runtime = runtime
        self.fallback = fallback  # for tiles below the engine's profile
        self.said_fallback = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the engine; an edge tile smaller than the profile through the PyTorch half instead.

        Padding such a tile up to the profile would join the padding into the decoder's GroupNorm statistics
        (seen: edge pixels off by up to 3.0 at 800 px on tiny); the PyTorch half gives diffusers' own result.
        """
        spec = self.runtime.spec
        low_h, low_w = self.smallest_input()
        height, width = x.shape[-2:]
        if height < low_h or width < low_w:
            if not self.said_fallback:  # once per VAE half
                self.said_fallback = True
                console.print(
                    f"[yellow]note:[/] a {spec.component} tile of {pixel_size(height, width)} is below the engine's "
                    f"smallest input, {pixel_size(low_h, low_w)}, so such tiles run on the PyTorch VAE; to keep every "
                    "tile on the engine, build the VAE with a smaller --height/--width minimum or pick a size whose "
                    "tiles fit"
                )
            return self.fallback(x)
        return self.runtime.run({spec.input_names[0]: x})[spec.output_names[0]].to(x.device, x.dtype)

    def smallest_input(self) -> tuple[int, int]:
        """The smallest input height and width the engine's profile takes (in latents for the decoder)."""
        profile = getattr(self.runtime, "profile", None)
        if profile is None:
            return 0, 0
        per = getattr(self.runtime.spec, "vae_scale_factor", 8) if self.runtime.spec.component == "vae_decoder" else 1
        return -(-profile.height.min // per), -(-profile.width.min // per)


class PyTorchHalf(torch.nn.Module):
    """The half of a VAE an engine set lacks, on the PyTorch VAE (loaded on first use)."""

    def __init__(self, load: Callable[[], Any], encoder: bool) -> None:
        super().__init__()
        self.load, self.encoder = load, encoder
        self.vae: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.vae is None:
            self.vae = self.load()
        vae = self.vae.to(x.device, x.dtype)
        if self.encoder:
            h = vae.encoder(x)
            return vae.quant_conv(h) if vae.quant_conv is not None else h
        return vae.decoder(vae.post_quant_conv(x) if vae.post_quant_conv is not None else x)


class EngineHalves(EngineModule):
    """What a VAE stand-in is: its ``encoder`` and ``decoder`` are engines; a half the set lacks runs in PyTorch.

    The diffusers class's own ``encode``/``decode`` (AutoencoderKL's, or AutoencoderKLFlux2's, the same) run over
    them, so slicing (a batch loop) and tiling (tiles decoded through the same engine, blended as diffusers blends
    them) work as on the PyTorch VAE. Tiles are as large as diffusers makes them, and no larger than the engine's
    profile.
    """

    def __init__(
        self, config: dict[str, Any], decoder: Runtime | None, encoder: Runtime | None,
        pytorch: Callable[[], Any], dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        super().__init__(config, dtype, [decoder, encoder])
        self.decoder_runtime, self.encoder_runtime = decoder, encoder
        on_pytorch = PyTorchHalf(pytorch, encoder=True), PyTorchHalf(pytorch, encoder=False)
        self.encoder = EngineHalf(encoder, on_pytorch[0]) if encoder is not None else on_pytorch[0]
        self.decoder = EngineHalf(decoder, on_pytorch[1]) if decoder is not None else on_pytorch[1]
        self.quant_conv, self.post_quant_conv = InGraph(dtype), InGraph(dtype)  # the halves apply them
        self.use_slicing = self.use_tiling = False
        self.tile_overlap_factor = 0.25
        size = self.config.sample_size
        sample_px = size[0] if isinstance(size, list | tuple) else size
        scale = 2 ** (len(self.config.block_out_channels) - 1)
        # One tuple: min() of a lone int (no engine profile on record, as for a graph) is a TypeError.
        self.tile_latent_min_size = min(
            (sample_px // scale, *tile_limits(decoder, scale), *tile_limits(encoder, scale))
        )
        self.tile_sample_min_size = self.tile_latent_min_size * scale


class EngineVAE(EngineHalves, AutoencoderKL):
    """An AutoencoderKL stand-in (EngineHalves)."""


class InGraph(torch.nn.Identity):
    """A quant conv the engine's graph already applies, with an empty parameter in the VAE's dtype: SDXL
    pipelines read ``vae.post_quant_conv``'s parameter dtype when they upcast the VAE."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype_anchor = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def tile_limits(runtime: Runtime | None, scale: int) -> tuple[int, ...]:
    """The largest latent tile an engine's profile takes, or nothing when it has no profile on record."""
    profile = getattr(runtime, "profile", None)
    if profile is None:
        return ()
    return (min(profile.height.max, profile.width.max) // scale,)
