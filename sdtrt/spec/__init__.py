"""Graph contracts: each component's IO, derived from its diffusers/transformers config in one place.

IO names, dtypes, named dynamic axes, sample inputs and TensorRT min/opt/max shapes all come from
here, so export, build, runtimes and validation cannot disagree about them. One spec class per
component kind, one module each — ``unet``, ``transformer``, ``controlnet``, ``text_encoder``, ``vae`` —
over ``base.GraphSpec`` (named axes into shapes, profiles and checks) and, for networks a sampler calls
each step, ``denoiser.DenoiserSpec``. A new kind is a new module and a row in SPEC_CLASSES; where one
component's folder may hold several classes (T5 or CLIP, SD3's or Flux's transformer), the class of the
model's folder picks the spec (``spec_class``).

Axes: ``batch``; ``height``/``width`` in latents; ``image_height``/``image_width`` in pixels; ``tokens``
(T5's), ``text_tokens`` (CLIP's 77 + T5's) and ``patches`` (Flux's packed latents).
"""

from __future__ import annotations

from typing import Any

from ..core.config import (
    BUILDABLE,
    COMPONENTS,
    FREEU_MEMBER,
    TRANSFORMER_PARTS,
    UNET_PARTS,
    VISION_ENCODER,
    Component,
    IONaming,
    Precision,
)
from ..core.errors import ArtifactError, UnsupportedModelError
from ..core.families import QWEN_IMAGE_EDIT_PIPELINES
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
from .controlnet_flux import FluxControlNetSpec
from .denoiser import DenoiserSpec, residual_layout, residual_names
from .image_encoder import ImageEncoderSpec
from .llm_encoder import (
    LLMEncoderSpec,
    LLMModelEncoderSpec,
    MistralEncoderSpec,
    QwenVLEncoderSpec,
    QwenVLImageEncoderSpec,
)
from .qwen_vision import QwenVisionTowerSpec
from .text_encoder import T5Encoder2Spec, T5EncoderSpec, TextEncoder2Spec, TextEncoderSpec
from .transformer import (
    TRANSFORMER_KINDS,
    Flux2TransformerSpec,
    FluxTransformerSpec,
    SD3TransformerSpec,
    TransformerSpec,
)
from .transformer_qwen import QwenImageTransformerSpec
from .transformer_split import PART_CLASSES, TransformerPartSpec
from .transformer_zimage import ZImageTransformerSpec
from .unet import UNetSpec
from .unet_freeu import UNetFreeUSpec
from .unet_split import PART_CLASSES as UNET_PART_CLASSES
from .unet_split import UNetPartSpec
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
    "Flux2TransformerSpec",
    "FluxControlNetSpec",
    "FluxTransformerSpec",
    "GraphSpec",
    "ImageEncoderSpec",
    "LLMEncoderSpec",
    "MistralEncoderSpec",
    "ModelConfigs",
    "QwenImageTransformerSpec",
    "QwenVLEncoderSpec",
    "QwenVLImageEncoderSpec",
    "QwenVisionTowerSpec",
    "SD3TransformerSpec",
    "Shapes",
    "T5Encoder2Spec",
    "T5EncoderSpec",
    "TensorSpec",
    "TextEncoder2Spec",
    "TextEncoderSpec",
    "TransformerPartSpec",
    "TransformerSpec",
    "UNetFreeUSpec",
    "UNetPartSpec",
    "UNetSpec",
    "VaeDecoderSpec",
    "VaeEncoderSpec",
    "ValidationCase",
    "ZImageTransformerSpec",
    "component_spec",
    "denoiser_component",
    "folder_architecture",
    "model_components",
    "residual_layout",
    "residual_names",
    "spec_class",
    "spec_from_json",
    "split_members",
]  # fmt: skip

# (component, architecture) → spec; architecture "" where the component alone decides. The transformer's
# rows dispatch on its class themselves (TransformerSpec.for_model / from_json); each kind has its row too, so what
# a kind declares of its class (Z-Image's fp16 problem) is read before a spec is made (compile's precision).
SPECS: tuple[type[GraphSpec], ...] = (
    UNetSpec, TransformerSpec, *TRANSFORMER_KINDS.values(), ControlNetSpec, FluxControlNetSpec, TextEncoderSpec,
    TextEncoder2Spec, T5EncoderSpec, T5Encoder2Spec,
    VaeDecoderSpec, VaeEncoderSpec, *PART_CLASSES, *UNET_PART_CLASSES, UNetFreeUSpec, ImageEncoderSpec, LLMEncoderSpec,
    QwenVLEncoderSpec,
    LLMModelEncoderSpec, MistralEncoderSpec, QwenVisionTowerSpec,
)  # fmt: skip
SPEC_CLASSES: dict[tuple[str, str], type[GraphSpec]] = {(cls.component, cls.architecture): cls for cls in SPECS}


def spec_class(component: str, architecture: str = "") -> type[GraphSpec]:
    """The spec of a component whose folder holds an ``architecture`` (the class model_index.json names):
    T5EncoderModel in a text encoder's folder is T5's contract, anything else there CLIP's."""
    cls = SPEC_CLASSES.get((component, architecture)) or SPEC_CLASSES.get((component, ""))
    if cls is not None:
        return cls
    if known := [a for c, a in SPEC_CLASSES if c == component]:  # a component of some classes alone (vision_encoder)
        raise UnsupportedModelError(
            f"sdtrt builds a {component} from a {' or '.join(known)}, not from a {architecture or 'model without one'}"
        )
    raise ArtifactError(f"unknown component '{component}'; sdtrt builds {', '.join(BUILDABLE)}")


def spec_from_json(data: dict[str, Any]) -> GraphSpec:
    """The spec a manifest recorded (manifests from before components existed describe a UNet)."""
    return spec_class(data.get("component", "unet"), data.get("architecture", "")).from_json(data)


def folder_architecture(model: ModelConfigs, component: str) -> str:
    """The class of the component's folder in the model ("" where it has none: a bare UNet folder)."""
    folder = FOLDERS.get(component, "")
    return model.component_class(folder)[1] if folder and model.has(folder) else ""


def component_spec(
    model: ModelConfigs, component: Component, precision: Precision = "fp16", io_naming: IONaming = "named"
) -> GraphSpec:
    """The contract of one of the model's networks, from its config."""
    return spec_class(component, folder_architecture(model, component)).for_model(model, precision, io_naming)


# The denoiser kinds, in the order a model's folders are tried.
DENOISERS: tuple[type[DenoiserSpec], ...] = (UNetSpec, TransformerSpec)


def denoiser_class(model: ModelConfigs) -> type[DenoiserSpec]:
    """The kind of the model's denoiser: the first whose sub-folder it has (a bare folder is a UNet)."""
    return next((cls for cls in DENOISERS if model.has(FOLDERS[cls.component])), UNetSpec)


def denoiser_component(model: ModelConfigs) -> Component:
    """The model's denoiser component: ``unet`` or ``transformer``."""
    return denoiser_class(model).component


def denoiser_spec(model: ModelConfigs, precision: Precision = "fp16", io_naming: IONaming = "named") -> DenoiserSpec:
    """The contract of the model's denoiser: its latent grid, native size and default profile are the model's."""
    spec = denoiser_class(model).for_model(model, precision, io_naming)
    assert isinstance(spec, DenoiserSpec)  # each kind's for_model builds its own class
    return spec


def model_components(model: ModelConfigs) -> tuple[Component, ...]:
    """The components a model has: those with a sub-folder in a pipeline folder, its denoiser alone in a bare one;
    and the vision tower of a pipeline that runs its image through its text encoder (Qwen-Image-Edit's)."""
    denoiser = denoiser_component(model)
    networks = tuple(c for c in COMPONENTS if c == denoiser or model.has(FOLDERS[c]))
    edits = model.is_pipeline and model.pipeline_class() in QWEN_IMAGE_EDIT_PIPELINES
    return (*networks, VISION_ENCODER) if edits and model.has(FOLDERS[VISION_ENCODER]) else networks


def split_members(model: ModelConfigs) -> tuple[Component, ...]:
    """The members step caches and FreeU may add to the model's engine set: its transformer's parts, or its UNet's
    DeepCache parts and FreeU build."""
    return TRANSFORMER_PARTS if denoiser_component(model) == "transformer" else (*UNET_PARTS, FREEU_MEMBER)
