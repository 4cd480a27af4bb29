"""The networks a model is split into, each exported and built as its own graph."""

from __future__ import annotations

from typing import Literal

# The networks a pipeline calls, each exported and built as its own graph.
# A model's denoiser is a UNet (SD 1.x/2.x, SDXL) or a transformer (SD3, Flux); text_encoder_3 is SD3's T5.
Component = Literal[
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder",
]  # fmt: skip
COMPONENTS: tuple[Component, ...] = (
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder",
)  # fmt: skip
TEXT_ENCODERS: tuple[Component, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
