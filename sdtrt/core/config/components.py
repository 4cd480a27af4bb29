"""The networks a model is split into, each exported and built as its own graph."""

from __future__ import annotations

from typing import Literal

# The networks a pipeline calls, each exported and built as its own graph.
# A model's denoiser is a UNet (SD 1.x/2.x, SDXL) or a transformer (SD3, Flux); text_encoder_3 is SD3's T5.
Component = Literal[
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder", "transformer_embed", "transformer_first_block", "transformer_rest", "transformer_out", "unet_deep",
    "unet_shallow", "unet_freeu", "image_encoder", "vision_encoder",
]  # fmt: skip
COMPONENTS: tuple[Component, ...] = (
    "unet", "transformer", "controlnet", "text_encoder", "text_encoder_2", "text_encoder_3", "vae_decoder",
    "vae_encoder",
)  # fmt: skip
TEXT_ENCODERS: tuple[Component, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
# The transformer again, in parts, for step caches that skip its blocks (spec/transformer_split.py): built only when
# asked (compile's caches=), never among a model's components by default.
TRANSFORMER_PARTS: tuple[Component, ...] = (
    "transformer_embed", "transformer_first_block", "transformer_rest", "transformer_out",
)  # fmt: skip
# The UNet again, as DeepCache runs it (spec/unet_split.py): the whole UNet that also hands out the deep feature it
# caches, and the shallow branch that takes that feature back in on the steps between.
UNET_PARTS: tuple[Component, ...] = ("unet_deep", "unet_shallow")
# The UNet again, with FreeU's factors as an input (spec/unet_freeu.py): built only when asked (compile's freeu=), so
# the plain UNet engine stays as it was and runs whenever FreeU is off.
FREEU_MEMBER: Component = "unet_freeu"
# An IP-Adapter's CLIP image encoder (spec/image_encoder.py): it comes with the adapter, not the model, and joins the
# set of a UNet compiled with one (ExportConfig.ip_adapter).
IMAGE_ENCODER: Component = "image_encoder"
# A vision-language text encoder's vision tower (spec/qwen_vision.py: Qwen2.5-VL's, which the Qwen-Image-Edit
# pipelines run on their input image), from the text encoder's folder: built only when asked, never among a model's
# components by default (Qwen-Image's text-to-image sets run no image through their text encoder).
VISION_ENCODER: Component = "vision_encoder"
BUILDABLE: tuple[Component, ...] = (
    COMPONENTS + TRANSFORMER_PARTS + UNET_PARTS + (FREEU_MEMBER, IMAGE_ENCODER, VISION_ENCODER)
)

# Step caches compile can build the split members for (compile's caches=), and the members each needs. The three
# transformer caches skip the same blocks, so they share one split; DeepCache splits the UNet.
STEP_CACHES: dict[str, tuple[Component, ...]] = dict.fromkeys(
    ("first-block", "magcache", "taylorseer"), TRANSFORMER_PARTS
) | {"deepcache": UNET_PARTS}
