"""FLUX.1 ControlNet samples: their names and counts, which the ControlNet's graph gives (spec/controlnet_flux.py) and
the transformer's graph of a ControlNet set takes (FluxTransformerSpec.controlnet_samples)."""

from __future__ import annotations

from typing import Any

from ..core.errors import UnsupportedModelError

BLOCK_SAMPLE = "controlnet_block_sample_"  # + the double block's index: an output here, a transformer input there
SINGLE_BLOCK_SAMPLE = "controlnet_single_block_sample_"


def controlnet_sample_names(samples: tuple[int, int]) -> tuple[str, ...]:
    """The names of (double-block, single-block) sample counts ``samples``: the double blocks', then the single's."""
    blocks, singles = samples
    return (*(f"{BLOCK_SAMPLE}{i}" for i in range(blocks)), *(f"{SINGLE_BLOCK_SAMPLE}{i}" for i in range(singles)))


def controlnet_samples(config: dict[str, Any]) -> tuple[int, int]:
    """The (double-block, single-block) samples a FluxControlNetModel of this config gives; UnsupportedModelError for
    the kinds its graph does not run: XLabs' (an input hint block on the control image's pixels, its samples repeated
    over the transformer's blocks) and ControlNet-Union's (a control mode token before the text)."""
    if config.get("conditioning_embedding_channels") is not None:
        raise UnsupportedModelError(
            "this FluxControlNetModel takes the control image's pixels (an XLabs-style input_hint_block, its samples "
            "repeated over the blocks), which sdtrt does not export: InstantX-style FLUX.1 ControlNets (the control "
            "image's packed latents) are supported"
        )
    if config.get("num_mode") is not None:
        raise UnsupportedModelError(
            "this FluxControlNetModel is a ControlNet-Union (num_mode: a control_mode token before the text), which "
            "sdtrt does not export: single-mode FLUX.1 ControlNets are supported"
        )
    samples = (int(config.get("num_layers", 19)), int(config.get("num_single_layers", 38)))
    if not any(samples):
        raise UnsupportedModelError("this FluxControlNetModel has no blocks (num_layers = num_single_layers = 0)")
    return samples
