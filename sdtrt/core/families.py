"""Model families: which Stable Diffusion variant a folder holds, read from its configs alone.

The UNet's config says what its graph takes beyond ``sample, timestep, encoder_hidden_states``:
SDXL's added conditioning (``addition_embed_type: text_time`` → ``text_embeds`` and ``time_ids``),
LCM's guidance embedding (``time_cond_proj_dim`` → ``timestep_cond``), inpainting's masked-image
channels (``in_channels: 9``). A transformer's config names its kind (``SD3Transformer2DModel``: SD3 and
SD3.5; ``FluxTransformer2DModel``: Flux.1, dev with ``guidance_embeds``, schnell without).
``model_index.json`` names the pipeline class, and with it the txt2img / img2img / inpaint classes of the
same family. Light to import: no torch, no diffusers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

from .errors import RequestError, UnsupportedModelError

Task = Literal["txt2img", "img2img", "inpaint"]
TASKS: tuple[Task, ...] = ("txt2img", "img2img", "inpaint")

# One row per family of diffusers pipelines: the class for each task.
PIPELINE_TASKS: tuple[dict[Task, str], ...] = (
    {"txt2img": "StableDiffusionPipeline", "img2img": "StableDiffusionImg2ImgPipeline",
     "inpaint": "StableDiffusionInpaintPipeline"},
    {"txt2img": "StableDiffusionXLPipeline", "img2img": "StableDiffusionXLImg2ImgPipeline",
     "inpaint": "StableDiffusionXLInpaintPipeline"},
    {"txt2img": "LatentConsistencyModelPipeline", "img2img": "LatentConsistencyModelImg2ImgPipeline"},
    {"txt2img": "StableDiffusionControlNetPipeline", "img2img": "StableDiffusionControlNetImg2ImgPipeline",
     "inpaint": "StableDiffusionControlNetInpaintPipeline"},
    {"txt2img": "StableDiffusionXLControlNetPipeline", "img2img": "StableDiffusionXLControlNetImg2ImgPipeline",
     "inpaint": "StableDiffusionXLControlNetInpaintPipeline"},
    {"txt2img": "StableDiffusion3Pipeline", "img2img": "StableDiffusion3Img2ImgPipeline",
     "inpaint": "StableDiffusion3InpaintPipeline"},
    {"txt2img": "FluxPipeline", "img2img": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline"},
    # FLUX.1 Fill (in_channels 384: + masked-image latents and mask), Canny / Depth (128: + control latents), Kontext.
    {"inpaint": "FluxFillPipeline"},
    {"txt2img": "FluxControlPipeline", "img2img": "FluxControlImg2ImgPipeline",
     "inpaint": "FluxControlInpaintPipeline"},
    {"img2img": "FluxKontextPipeline", "inpaint": "FluxKontextInpaintPipeline"},
    # FLUX.1 ControlNets (InstantX's FluxControlNetModel: block samples the transformer adds).
    {"txt2img": "FluxControlNetPipeline", "img2img": "FluxControlNetImg2ImgPipeline",
     "inpaint": "FluxControlNetInpaintPipeline"},
    # FLUX.2 [klein]: reference images (editing) go to the txt2img pipeline as its `image`; its inpainting one reads
    # the image to repaint as a reference too (its latents after the generated tokens), and an optional image_reference.
    {"txt2img": "Flux2KleinPipeline", "inpaint": "Flux2KleinInpaintPipeline"},
    {"txt2img": "Flux2Pipeline"},  # FLUX.2 [dev]: the same, its text encoder a Mistral3 model
    {"txt2img": "ZImagePipeline", "img2img": "ZImageImg2ImgPipeline", "inpaint": "ZImageInpaintPipeline"},
    {"txt2img": "QwenImagePipeline", "img2img": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline"},
    # an edit of its input image (no strength: denoised from noise); its inpainting one repaints the input image at the
    # condition image's size (~1024², the input's aspect ratio) where the mask is white, its own strength
    {"img2img": "QwenImageEditPipeline", "inpaint": "QwenImageEditInpaintPipeline"},
    {"img2img": "QwenImageEditPlusPipeline"},  # the same of one to three input images (Qwen-Image-Edit-2509's)
)  # fmt: skip
# Pipelines that append the packed latents of a reference image to the image tokens (the transformer's sequence).
REFERENCE_TOKEN_PIPELINES = ("FluxKontextPipeline",)
# Pipelines whose `image` is optional: reference images to edit from (their own profile axis), not an img2img start.
REFERENCE_IMAGE_PIPELINES = ("Flux2KleinPipeline", "Flux2Pipeline")
# Inpainting pipelines that read the image to repaint as a reference too (its latents after the generated tokens, one
# reference of the profile's) and an optional image_reference (another), and make the input image's size, whatever
# height and width they are given (FLUX.2 [klein]'s: scaled down to 1024² when larger, cut to its grid).
INPAINT_REFERENCE_PIPELINES = ("Flux2KleinInpaintPipeline",)
SUPPORTED = (
    "SD 1.x and 2.x (epsilon and v-prediction), SDXL base, refiner and Turbo, inpainting UNets "
    "(in_channels 9), LCM-distilled UNets and ControlNet, and the transformers of SD3 / SD3.5, Flux.1 "
    "dev / schnell (with Fill, Canny / Depth control, Kontext and ControlNet), FLUX.2 [klein] and [dev], Z-Image "
    "and Qwen-Image"
)
# Transformer class → family; Flux's depends on its guidance embedding (dev) or its absence (schnell).
TRANSFORMERS = {
    "SD3Transformer2DModel": "sd3", "FluxTransformer2DModel": "flux", "Flux2Transformer2DModel": "flux2",
    "ZImageTransformer2DModel": "zimage", "QwenImageTransformer2DModel": "qwenimage",
}  # fmt: skip
# T5's token count by default (the pipelines' max_sequence_length): SD3 256, Flux dev 512, schnell 256.
T5_TOKENS = {"sd3": 256, "flux": 512, "flux-schnell": 256}
# The most prompt tokens an LLM text encoder gives the transformer by default: Flux2KleinPipeline's and
# ZImagePipeline's max_sequence_length; QwenImagePipeline's cap (its check_inputs refuses more; its
# max_sequence_length default is 512).
LLM_TOKENS = {"flux2": 512, "zimage": 512, "qwenimage": 1024}
# The prompt tokens Qwen-Image's engines are tuned for by default: QwenImagePipeline pads a batch to its longest prompt
# (T5's pipelines pad to max_sequence_length), and most prompts are shorter than this. Not measured on a GPU.
QWEN_IMAGE_TUNED_TOKENS = 256
# The chat template's leading tokens QwenImagePipeline runs through the LLM and then drops (its
# prompt_template_encode_start_idx): the LLM engine reads this many tokens more than the transformer.
QWEN_IMAGE_DROPPED_TOKENS = 34
# QwenImageEditPipeline's: its template (a longer system prompt, then the image's vision tokens) drops 64.
QWEN_IMAGE_EDIT_DROPPED_TOKENS = 64
# The Qwen-Image pipelines that run an image through their Qwen2.5-VL text encoder (its vision tower, then the
# language model on the prompt's tokens with the image's embeddings in place of its image-pad tokens).
QWEN_IMAGE_EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline")
# The most condition images an Edit pipeline's engines take in a call (Qwen-Image-Edit-2509's model card: one to
# three work best); each is ~1024² for the VAE and the transformer.
QWEN_EDIT_IMAGES = {"QwenImageEditPipeline": 1, "QwenImageEditPlusPipeline": 3, "QwenImageEditInpaintPipeline": 1}
# The pixels an Edit pipeline resizes each condition image to for its vision tower, at the image's aspect ratio
# (calculate_dimensions' area: QwenImageEditPipeline's 1024², QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE).
QWEN_EDIT_VISION_AREA = {
    "QwenImageEditPipeline": 1024 * 1024,
    "QwenImageEditPlusPipeline": 384 * 384,
    "QwenImageEditInpaintPipeline": 1024 * 1024,
}
# The text QwenImageEditPlusPipeline writes before the prompt for each image (its _get_qwen_prompt_embeds): the
# Edit pipeline's template holds the one image's vision tokens itself.
QWEN_PLUS_PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
# The hidden states a pipeline reads from its LLM text encoder, at transformers' indices (0 the embedding; negative
# from the end, as the pipeline indexes them): FLUX.2 [klein] and [dev] stack their text_encoder_out_layers
# defaults, Z-Image's pipelines take hidden_states[-2].
LLM_LAYERS: dict[str, tuple[int, ...]] = {
    "Flux2KleinPipeline": (9, 18, 27),
    **dict.fromkeys(("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"), (-2,)),
    "Flux2Pipeline": (10, 20, 30),
}
# SDXL's time_ids: original size, crop corner, target size (6); the refiner swaps the target size for
# an aesthetic score (5). Each id is embedded with addition_time_embed_dim sinusoids.
SDXL_TIME_IDS = (6, 5)


@dataclass(frozen=True)
class UNetConditioning:
    """Sizes of the UNet graph's inputs beyond sample, timestep and encoder_hidden_states (0: absent)."""

    text_embeds_dim: int = 0  # SDXL: the pooled text embedding of text_encoder_2
    time_ids_dim: int = 0  # SDXL: 6 (base), 5 (refiner)
    timestep_cond_dim: int = 0  # LCM: the guidance-scale embedding

    @classmethod
    def of(cls, unet_config: dict[str, Any], text_embeds_dim: int | None = None) -> UNetConditioning:
        """From the UNet's config; ``text_embeds_dim`` (text_encoder_2's projection_dim) settles SDXL's split.

        Without it (a bare UNet folder) 6 time ids (base) are tried before 5 (refiner).
        """
        check_supported_unet(unet_config)
        timestep_cond = int(unet_config.get("time_cond_proj_dim") or 0)
        if unet_config.get("addition_embed_type") != "text_time":
            return cls(timestep_cond_dim=timestep_cond)
        total = int(unet_config["projection_class_embeddings_input_dim"])
        per_id = int(unet_config["addition_time_embed_dim"])
        candidates = [text_embeds_dim] if text_embeds_dim else [total - n * per_id for n in SDXL_TIME_IDS]
        text = next((t for t in candidates if t > 0 and (total - t) % per_id == 0), 0)
        if not text:
            raise UnsupportedModelError(
                f"cannot split this SDXL UNet's added conditioning ({total} = text_embeds + time_ids × {per_id})"
            )
        return cls(text_embeds_dim=text, time_ids_dim=(total - text) // per_id, timestep_cond_dim=timestep_cond)


def check_supported_unet(config: dict[str, Any]) -> None:
    """Refuse UNets whose conditioning the exported graph would silently drop, saying what is supported."""
    unsupported = {
        "class_embed_type": "class-label conditioning",
        "encoder_hid_dim_type": "projected encoder hidden states",
    }
    problems = [f"{what} ({key}={config[key]!r})" for key, what in unsupported.items() if config.get(key)]
    added = config.get("addition_embed_type")
    if added not in (None, "text_time"):
        problems.append(f"added conditioning of type {added!r}")
    if config.get("_class_name", "UNet2DConditionModel") not in ("UNet2DConditionModel", "ControlNetModel"):
        problems.append(f"a {config['_class_name']} (not a UNet2DConditionModel or ControlNetModel)")
    if problems:
        raise UnsupportedModelError(f"this model uses {problems[0]}; sdtrt supports {SUPPORTED}")


def family_name(
    unet_config: dict[str, Any], scheduler_config: dict[str, Any] | None = None, text_embeds_dim: int | None = None,
    controlnet: bool = False,
) -> str:  # fmt: skip
    """A short label: sd1, sd2, sdxl, sdxl-refiner, with -inpaint, -lcm, -controlnet and -v (v-prediction)."""
    conditioning = UNetConditioning.of(unet_config, text_embeds_dim)
    if conditioning.time_ids_dim:
        name = "sdxl" if conditioning.time_ids_dim == 6 else "sdxl-refiner"
    else:
        name = "sd2" if unet_config.get("use_linear_projection") else "sd1"  # SD 2's transformer blocks
    if unet_config.get("in_channels", 4) == 9:
        name += "-inpaint"
    if conditioning.timestep_cond_dim:
        name += "-lcm"
    if controlnet:
        name += "-controlnet"
    if (scheduler_config or {}).get("prediction_type") == "v_prediction":
        name += "-v"
    return name


def transformer_family(config: dict[str, Any]) -> str:
    """sd3 (SD3, SD3.5), flux (Flux.1 dev: guidance embedding) or flux-schnell, from a transformer's config."""
    class_name = config.get("_class_name", "")
    if class_name not in TRANSFORMERS:
        raise UnsupportedModelError(
            f"this model's denoiser is a {class_name or 'transformer without a class name'}; sdtrt supports {SUPPORTED}"
        )
    family = TRANSFORMERS[class_name]
    return family if family != "flux" or config.get("guidance_embeds") else "flux-schnell"


def pipeline_class_name(index_class: str, task: Task | None) -> str:
    """The diffusers class for ``task`` in the family of the pipeline ``model_index.json`` names."""
    if task is None:
        return index_class
    row = supported_row(index_class)
    if task not in row:
        raise RequestError(f"the {index_class} family has no {task} pipeline (it has {', '.join(row)})")
    return row[task]


# The img2img pipelines that take a height and width (SD's, SDXL's and LCM's make the input image's size).
SIZED_IMG2IMG = ("StableDiffusion3", "Flux", "ZImage", "QwenImage")


def pipeline_inputs(class_name: str) -> frozenset[str]:
    """Which of a request's optional inputs (negative_prompt, image, mask_image, control_image, image_reference,
    strength, height) the ``__call__`` of a PIPELINE_TASKS class takes, read from its name: a request is checked before
    diffusers is imported (8 s), and tests hold this to diffusers' signatures. ControlNet txt2img pipelines take their
    control image as ``image`` (their img2img / inpaint ones, and FLUX.1 Canny / Depth's, as ``control_image``);
    Kontext's reference image is its ``image``, as Qwen-Image-Edit's image to edit is (Kontext's and FLUX.2 [klein]'s
    inpainting pipelines' an optional ``image_reference``, ``image`` being repainted), and FLUX.2 [klein]'s optional
    reference images too; FLUX.1 ControlNet pipelines take a ``control_image`` for every task (a negative prompt for
    txt2img only). SD, SDXL and LCM img2img take no height (nor width): they make the input image's size (SD3's,
    FLUX.1's, Z-Image's and Qwen-Image's take one)."""
    img2img, inpaint = "Img2Img" in class_name, "Inpaint" in class_name or "Fill" in class_name
    kontext, controlnet = "Kontext" in class_name, "ControlNet" in class_name
    edits = kontext or class_name in QWEN_IMAGE_EDIT_PIPELINES  # the image to edit, as Kontext's reference
    flux_control = class_name.startswith("FluxControl") and not controlnet  # FLUX.1 Canny / Depth
    flux_controlnet = class_name.startswith("FluxControlNet")
    reference = class_name in REFERENCE_IMAGE_PIPELINES  # FLUX.2 [klein]: true CFG without a negative prompt
    klein = class_name.startswith("Flux2Klein")  # its inpainting pipeline's negative prompt is "" too
    no_negative = class_name.startswith(("LatentConsistencyModel", "FluxFill")) or flux_control or reference or klein
    inputs = {
        "negative_prompt": not (no_negative or (flux_controlnet and (img2img or inpaint))),
        "image": img2img or inpaint or edits or (controlnet and not flux_controlnet) or reference,
        "mask_image": inpaint,
        "control_image": flux_control or flux_controlnet or (controlnet and (img2img or inpaint)),
        "image_reference": (kontext or klein) and inpaint,  # its own reference, where ``image`` is repainted
        "strength": img2img or inpaint,
        "height": not img2img or controlnet or class_name.startswith(SIZED_IMG2IMG),
    }
    return frozenset(name for name, taken in inputs.items() if taken)


def family_tasks(index_class: str) -> dict[Task, str]:
    """The task → pipeline class row of the family ``model_index.json``'s class belongs to ({} for none)."""
    return next((row for row in PIPELINE_TASKS if index_class in row.values()), {})


def served_tasks(index_class: str) -> dict[Task, str]:
    """The tasks (→ pipeline class) a model whose ``model_index.json`` names ``index_class`` runs: its whole family row
    when that is the row's first class (its txt2img one, or FLUX.1 Kontext's img2img, whose weights inpaint too), else
    that class's task alone. A model published for another task is made for it: an inpainting UNet (9 channels in),
    SDXL's refiner (no first text encoder), FLUX.1 Fill."""
    row = supported_row(index_class)
    if next(iter(row.values())) == index_class:
        return dict(row)
    return {task: name for task, name in row.items() if name == index_class}


def supported_row(index_class: str) -> dict[Task, str]:
    """``family_tasks``; UnsupportedModelError for a class in no family sdtrt runs."""
    if row := family_tasks(index_class):
        return row
    raise UnsupportedModelError(f"'{index_class}' pipelines are not supported; sdtrt supports {SUPPORTED}")


def accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``cls.__init__`` takes (SDXL pipelines have no safety checker)."""
    parameters = inspect.signature(cls).parameters
    return {k: v for k, v in kwargs.items() if k in parameters}


def llm_system_message(pipeline_class: str) -> str | None:
    """The system message a pipeline puts before each prompt in its LLM's chat (Flux2Pipeline's ``system_message``
    default, diffusers' own text), None for a pipeline with none."""
    if pipeline_class != "Flux2Pipeline":
        return None
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return str(SYSTEM_MESSAGE)
