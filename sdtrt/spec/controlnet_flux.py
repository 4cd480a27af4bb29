"""FLUX.1 ControlNets' graph contract (diffusers' FluxControlNetModel, InstantX's kind): the Flux transformer's inputs
plus the control image's packed latents and its scale → one sample per double block and per single block, which the
transformer adds after its own (FluxTransformerSpec.controlnet_samples: its ControlNet-set graph takes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.config import Component, IONaming, Precision
from ..core.families import T5_TOKENS, transformer_family
from .base import ModelConfigs, TensorSpec
from .controlnet_samples import controlnet_sample_names, controlnet_samples
from .transformer import FluxTransformerSpec


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
