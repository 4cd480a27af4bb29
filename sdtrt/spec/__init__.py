"""Graph contracts: each component's IO, derived from its diffusers/transformers config in one place.

IO names, dtypes, named dynamic axes, sample inputs and TensorRT min/opt/max shapes all come from
here, so export, build, runtimes and validation cannot disagree about them. One spec class per
component kind, one module each — ``unet``, ``controlnet``, ``text_encoder``, ``vae`` — over
``base.GraphSpec`` (named axes into shapes, profiles and checks) and, for networks a sampler calls
each step, ``denoiser.DenoiserSpec``. A new kind is a new module and a row in SPEC_CLASSES.

Axes: ``batch``; ``height``/``width`` in latents; ``image_height``/``image_width`` in pixels.
"""

from __future__ import annotations

from typing import Any

from ..config import COMPONENTS, Component, IONaming, Precision
from ..errors import ArtifactError
from .base import (
    AXIS_LABELS,
    FOLDERS,
    NAMED_INPUTS,
    NAMED_OUTPUT,
    TEXT_TOKENS,
    GraphSpec,
    ModelConfigs,
    Shapes,
    TensorSpec,
    ValidationCase,
)  # fmt: skip
from .controlnet import ControlNetSpec
from .denoiser import DenoiserSpec, residual_layout, residual_names
from .text_encoder import TextEncoder2Spec, TextEncoderSpec
from .unet import UNetSpec
from .vae import VaeDecoderSpec, VaeEncoderSpec

__all__ = [
    "AXIS_LABELS",
    "DENOISERS",
    "FOLDERS",
    "NAMED_INPUTS",
    "NAMED_OUTPUT",
    "SPEC_CLASSES",
    "TEXT_TOKENS",
    "ControlNetSpec",
    "DenoiserSpec",
    "GraphSpec",
    "ModelConfigs",
    "Shapes",
    "TensorSpec",
    "TextEncoder2Spec",
    "TextEncoderSpec",
    "UNetSpec",
    "VaeDecoderSpec",
    "VaeEncoderSpec",
    "ValidationCase",
    "component_spec",
    "denoiser_component",
    "model_components",
    "residual_layout",
    "residual_names",
    "spec_from_json",
]  # fmt: skip

SPEC_CLASSES: dict[str, type[GraphSpec]] = {
    cls.component: cls
    for cls in (UNetSpec, ControlNetSpec, TextEncoderSpec, TextEncoder2Spec, VaeDecoderSpec, VaeEncoderSpec)
}


def spec_from_json(data: dict[str, Any]) -> GraphSpec:
    """The spec a manifest recorded (manifests from before components existed describe a UNet)."""
    cls = SPEC_CLASSES.get(data.get("component", "unet"))
    if cls is None:
        raise ArtifactError(f"unknown component '{data['component']}' in a manifest; rebuild it with this sdtrt")
    return cls.from_json(data)


def component_spec(
    model: ModelConfigs, component: Component, precision: Precision = "fp16", io_naming: IONaming = "named"
) -> GraphSpec:
    """The contract of one of the model's networks, from its config."""
    cls = SPEC_CLASSES.get(component)
    if cls is None:
        raise ArtifactError(f"unknown component '{component}'; sdtrt builds {', '.join(COMPONENTS)}")
    return cls.for_model(model, precision, io_naming)


# The denoiser kinds, in the order a model's folders are tried. A transformer kind (SD3, Flux) is one more row.
DENOISERS: tuple[type[DenoiserSpec], ...] = (UNetSpec,)


def denoiser_class(model: ModelConfigs) -> type[DenoiserSpec]:
    """The kind of the model's denoiser: the first whose sub-folder it has (a bare folder is a UNet)."""
    return next((cls for cls in DENOISERS if model.has(FOLDERS[cls.component])), UNetSpec)


def denoiser_component(model: ModelConfigs) -> Component:
    """The model's denoiser component (``unet``; a transformer's next)."""
    return denoiser_class(model).component


def denoiser_spec(model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> DenoiserSpec:
    """The contract of the model's denoiser: its latent grid, native size and default profile are the model's."""
    spec = denoiser_class(model).for_model(model, precision, io_naming)
    assert isinstance(spec, DenoiserSpec)  # each kind's for_model builds its own class
    return spec


def model_components(model: ModelConfigs) -> tuple[Component, ...]:
    """The components a model has: those with a sub-folder in a pipeline folder, its denoiser alone in a bare one."""
    denoiser = denoiser_component(model)
    return tuple(c for c in COMPONENTS if c == denoiser or model.has(FOLDERS[c]))
