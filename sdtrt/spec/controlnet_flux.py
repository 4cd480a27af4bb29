"""FLUX.1 ControlNets' graph contract (diffusers' FluxControlNetModel, InstantX's kind): the Flux transformer's inputs
plus the control image's packed latents and its scale → one sample per double block and per single block, which the
transformer adds after its own (FluxTransformerSpec.controlnet_samples: its ControlNet-set graph takes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.config import Component, IONaming, Precision
from ..core.errors import UnsupportedModelError
from ..core.families import T5_TOKENS, transformer_family
from .base import ModelConfigs, TensorSpec
from .transformer import FluxTransformerSpec

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


@dataclass(frozen=True)
class FluxControlNetSpec(FluxTransformerSpec):
    """A FLUX.1 ControlNet: Flux's transformer inputs, ``controlnet_cond [B, patches, in_channels]`` (the control
    image's packed VAE latents) and ``conditioning_scale [1]`` (fp32) → ``controlnet_block_sample_i`` and
    ``controlnet_single_block_sample_i``, each ``[B, patches, controlnet_width]``, already scaled."""

    component: ClassVar[Component] = "controlnet"
    label: ClassVar[str] = "FLUX.1 ControlNet"
    architecture: ClassVar[str] = "FluxControlNetModel"
    repeated_blocks: ClassVar[dict[str, str]] = {}  # exported whole: ControlNets are a few blocks deep

    @classmethod
    def for_model(
        cls, model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named"
    ) -> FluxControlNetSpec:
        """This component's contract for ``model``: its ControlNet's config, the VAE's grid, the transformer's T5."""
        config = model.component_config("controlnet")
        factor = model.vae_scale_factor()
        family = transformer_family(model.component_config("transformer"))
        return cls(
            precision=precision, io_naming=io_naming, vae_scale_factor=factor,
            **cls.fields_from(config, model.component_config("vae"), factor),
            max_sequence_length=T5_TOKENS.get(family, cls.pipeline_tokens),
            controlnet_samples=controlnet_samples(config),
            controlnet_width=config["num_attention_heads"] * config["attention_head_dim"],
        )  # fmt: skip

    @property
    def canonical_outputs(self) -> tuple[str, ...]:  # type: ignore[override]
        return controlnet_sample_names(self.controlnet_samples)

    def input_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        flux = self.flux_inputs()
        return {
            "hidden_states": flux.pop("hidden_states"),
            "controlnet_cond": (None, ("batch", "patches", self.in_channels)),
            "conditioning_scale": ("float32", (1,)),  # one scale per call, as the pipeline passes it
            **flux,
        }

    def graph_tensors(self) -> dict[str, tuple[str | None, tuple[int | str, ...]]]:
        return self.input_tensors()  # no IP-Adapter, and the samples are this graph's outputs

    def outputs(self) -> list[TensorSpec]:
        shape = ("batch", "patches", self.controlnet_width)
        return [TensorSpec(name, self.dtype, shape) for name in self.output_names]
