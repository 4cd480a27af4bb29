"""What a user asks a pipeline for — prompt, steps, seed, image size, scheduler — checked before any work.

Light to import (no torch at import time): the CLI builds and checks a request before it loads a model,
so a bad value fails in a second with one line, not after the pipeline has loaded.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.config import DEFAULT_PROMPT, grid_problem
from ..core.errors import RequestError
from .image_inputs import check_control_image, check_inputs
from .token_limits import check_llm_prompts, check_t5_prompts

if TYPE_CHECKING:
    from ..core.config import ShapeProfile, ValidationConfig
    from ..sources.models import ModelSource
    from ..spec import DenoiserSpec

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed

# --scheduler names → diffusers classes (all built from the model's own scheduler config).
SCHEDULERS = {
    "pndm": "PNDMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler-a": "EulerAncestralDiscreteScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "lms": "LMSDiscreteScheduler",  # needs scipy, a dependency of sdtrt for this reason
    "unipc": "UniPCMultistepScheduler",
    "lcm": "LCMScheduler",  # consistency schedulers: the ones LatentConsistencyModelPipeline steps with
    "tcd": "TCDScheduler",
}
# The flow-matching schedulers SD3's and Flux's pipelines step with (their transformers predict a velocity,
# which the schedulers above cannot take). FlowMatchHeun's set_timesteps takes no sigmas, which FluxPipeline
# always passes (diffusers 0.42.1 pipeline_flux.py retrieve_timesteps): SD3 only. FlowMatchLCMScheduler runs
# in both, but draws each step's noise from torch's global generator (the pipelines hand step none), so a
# seed would not reproduce its image: not offered.
FLOW_SCHEDULERS = {"flow-euler": "FlowMatchEulerDiscreteScheduler", "flow-heun": "FlowMatchHeunDiscreteScheduler"}
FLOW_FAMILIES = ("sd3", "flux", "flux-schnell", "flux2", "qwenimage")
NOT_FOR_FLUX = ("flow-heun",)

# The LatentConsistencyModel pipelines pass original_inference_steps to set_timesteps, which only these take.
CONSISTENCY_SCHEDULERS = ("lcm", "tcd")


def check_scheduler(name: str, family: str, pipeline_class: str = "") -> str:
    """The diffusers class name for a --scheduler value a model of ``family`` (models.family()) can step with, in a
    pipeline of class ``pipeline_class`` (diffusers' name; "": any)."""
    flow = family in FLOW_FAMILIES
    if name not in SCHEDULERS and name not in FLOW_SCHEDULERS:
        raise RequestError(f"scheduler '{name}' is not one of {', '.join([*SCHEDULERS, *FLOW_SCHEDULERS])}")
    offered = FLOW_SCHEDULERS if flow else SCHEDULERS
    if family.startswith("flux"):
        offered = {n: c for n, c in offered.items() if n not in NOT_FOR_FLUX}
    if name not in offered:
        kind = "a flow-matching (SD3 / Flux) model" if flow else "a UNet model"
        raise RequestError(
            f"scheduler '{name}' cannot drive {kind} of family {family}; use one of {', '.join(offered)}"
        )
    if pipeline_class.startswith("LatentConsistencyModel") and name not in CONSISTENCY_SCHEDULERS:
        raise RequestError(
            f"the LatentConsistencyModel pipelines step only with {' or '.join(CONSISTENCY_SCHEDULERS)}, not {name}"
        )
    return offered[name]


@dataclass(frozen=True)
class SizeRule:
    """The image sizes (and guidance) a model can generate: one rule, from its denoiser's and VAE's configs.

    A request without guidance (or strength) runs with the default of its pipeline's ``__call__``, as diffusers has
    it per class (FluxPipeline 3.5, FluxFillPipeline 30, FluxControlImg2ImgPipeline 7, SDXL's 5): not passed.
    """

    multiple: int  # pixels: the VAE's scale factor times the denoiser's latent multiple
    default_height: int
    default_width: int
    takes_guidance: bool = True  # False: no guidance embedding (FLUX.1-schnell)
    # FluxPipeline reads a negative prompt only for true CFG (true_cfg_scale > 1), which a request does not ask for.
    takes_negative_prompt: bool = True
    # The pipeline's argument a request's guidance goes to: Qwen-Image's classifier-free guidance is true_cfg_scale
    # (with a negative prompt; its guidance_scale is for a guidance embedding Qwen-Image has not).
    guidance_keyword: str = "guidance_scale"

    @property
    def guides_with_negative_prompt(self) -> bool:
        """Whether guidance runs only with a negative prompt (QwenImagePipeline's true_cfg_scale needs one; None means
        no guidance there, not an empty negative prompt)."""
        return self.guidance_keyword == "true_cfg_scale"

    @classmethod
    def for_denoiser(cls, spec: DenoiserSpec) -> SizeRule:
        from ..spec import Flux2TransformerSpec, FluxTransformerSpec, QwenImageTransformerSpec

        native = spec.latent_sample_size * spec.vae_scale_factor
        if isinstance(spec, QwenImageTransformerSpec):
            return cls(spec.pixel_multiple, native, native, guidance_keyword="true_cfg_scale")
        if isinstance(spec, Flux2TransformerSpec):
            return cls(spec.pixel_multiple, native, native, takes_negative_prompt=False)  # klein: true CFG, no negative
        if isinstance(spec, FluxTransformerSpec):
            return cls(spec.pixel_multiple, native, native, spec.guidance_embeds, takes_negative_prompt=False)
        return cls(spec.pixel_multiple, native, native)

    @classmethod
    def for_pipeline(cls, pipe: Any) -> SizeRule:
        """The rule of a loaded pipeline's denoiser: its UNet, or SD3's / Flux's transformer."""
        from ..spec import UNetSpec
        from ..spec.transformer import TRANSFORMER_KINDS

        factor = pipe.vae_scale_factor
        if getattr(pipe, "transformer", None) is None:
            return cls.for_denoiser(UNetSpec.from_config(dict(pipe.unet.config), factor))
        config = dict(pipe.transformer.config)
        kind = TRANSFORMER_KINDS[config["_class_name"]]
        fields = kind.fields_from(config, dict(pipe.vae.config), factor)
        return cls.for_denoiser(kind(precision="fp32", io_naming="named", vae_scale_factor=factor, **fields))

    def applicable(self, guidance: float | None) -> float | None:
        """A configured (not user-asked) guidance where the model takes one, else None: validate's and bench's
        (None: the pipeline's own)."""
        return guidance if self.takes_guidance else None

    def resolve_guidance(self, guidance: float | None) -> float | None:
        """The guidance to run with (None: the pipeline's default); RequestError for one a model cannot take."""
        if not self.takes_guidance and guidance is not None:
            raise RequestError(
                f"guidance {guidance} was given, but this model has no guidance embedding (FLUX.1-schnell, "
                "a guidance-distilled model): leave --guidance out"
            )
        return guidance

    @classmethod
    def for_model(cls, model: ModelSource) -> SizeRule:
        from ..spec import denoiser_spec

        return cls.for_denoiser(denoiser_spec(model))

    def resolve(self, height: int | None, width: int | None) -> tuple[int, int]:
        """Both sides, a missing one taking the model's default; RequestError for a size off the grid."""
        sides = (
            ("height", self.default_height if height is None else height),
            ("width", self.default_width if width is None else width),
        )
        for name, value in sides:
            if problem := grid_problem(name, value, self.multiple):
                raise RequestError(problem)
        return sides[0][1], sides[1][1]


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str | None = None
    steps: int = 20
    guidance: float | None = None  # None: the pipeline's default (diffusers' __call__; FLUX.1-schnell takes none)
    seed: int = 0
    height: int | None = None  # None: the model's default
    width: int | None = None
    images: int = 1  # per prompt
    # img2img / inpaint / refiner pipelines: the input image and mask (PIL images, arrays or tensors).
    image: Any = None
    mask_image: Any = None
    strength: float | None = None  # None: the pipeline's default (diffusers' __call__: 0.6 Flux img2img, 1.0 Fill)
    # An IP-Adapter's image (its content guides the image): for a pipeline whose UNet has the adapter.
    ip_adapter_image: Any = None
    # FLUX.1 Canny / Depth (and SD ControlNet img2img / inpaint): the control image, in the output's aspect ratio.
    control_image: Any = None
    image_reference: Any = None  # FLUX.1 Kontext inpainting: the reference its edit reads (``image`` is repainted)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise RequestError(f"steps {self.steps} must be at least 1")
        if self.images < 1:
            raise RequestError(f"images per prompt {self.images} must be at least 1")
        if not 0 <= self.seed <= SEED_MAX:
            raise RequestError(f"seed {self.seed} is outside 0..{SEED_MAX}, the range torch's random generator takes")
        if self.guidance is not None and not math.isfinite(self.guidance):
            raise RequestError(f"guidance {self.guidance} must be a finite number")
        if self.strength is not None and not 0 <= self.strength <= 1:
            raise RequestError(f"strength {self.strength} is outside 0..1 (how much of the input image is repainted)")

    @property
    def batch_key(self) -> tuple[int, float | None, int, int]:
        """What text-to-image requests must share to run as one pipeline call (sized requests)."""
        return self.steps, self.guidance, self.height or 0, self.width or 0

    def sized_for(self, rule: SizeRule) -> GenerateRequest:
        """This request with both sides set and on the model's grid (diffusers would reset a lone side); RequestError
        for guidance given to a model that takes none."""
        height, width = rule.resolve(self.height, self.width)
        guidance = rule.resolve_guidance(self.guidance)
        if rule.guides_with_negative_prompt and self.negative_prompt is None:
            if guidance is not None and guidance > 1:
                raise RequestError(
                    f"guidance {guidance} was given without a negative prompt, but Qwen-Image's pipelines (Edit's too) "
                    'run classifier-free guidance (true_cfg_scale) only with one: pass a negative prompt (" " will '
                    "do), or leave --guidance out"
                )
            guidance = 1.0  # the pipeline's run without one, in every batch: no guidance
        if self.negative_prompt and not rule.takes_negative_prompt:
            raise RequestError(
                "a negative prompt was given, but FLUX.1 pipelines read one only for true classifier-free guidance "
                "(true_cfg_scale > 1: two transformer passes a step), which generate does not run: leave it out, "
                "or call the pipeline with negative_prompt and true_cfg_scale from Python"
            )
        return dataclasses.replace(self, height=height, width=width, guidance=guidance)

    def pipeline_kwargs(self, accepts: Collection[str]) -> dict[str, Any]:
        """Keyword arguments for a pipeline whose ``__call__`` takes ``accepts``; RequestError for what it lacks.

        Pipelines differ: LCM's takes no negative prompt, img2img and inpaint ones need an image (and a
        mask), and txt2img ones take no strength.
        """
        import torch

        wanted: dict[str, Any] = {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "num_inference_steps": self.steps,
            "guidance_scale": self.guidance,
            "height": self.height,
            "width": self.width,
            "num_images_per_prompt": self.images,
            "image": self.image,
            "mask_image": self.mask_image,
            "control_image": self.control_image,
            "image_reference": self.image_reference,
            "ip_adapter_image": self.ip_adapter_image,
            "generator": torch.Generator().manual_seed(self.seed),
        }
        check_inputs(self, accepts, image_optional="max_area" in accepts and "mask_image" not in accepts)
        if self.height and self.width:
            check_control_image(self.control_image, self.height, self.width)
        if "strength" in accepts and self.image is not None and self.strength is not None:
            wanted["strength"] = self.strength
        if "max_area" in accepts and self.height and self.width:
            # FLUX.1 Kontext: the asked size (it would scale it to 1 MP); the image is resized (fit_reference).
            wanted |= {"max_area": self.height * self.width, "_auto_resize": False}
        return {k: v for k, v in wanted.items() if k in accepts and (v is not None or k != "guidance_scale")}


def check_steps(steps: int, scheduler_config: Any) -> None:
    """RequestError when the scheduler cannot run ``steps`` steps: none spaces more steps than the timesteps it was
    trained on (PNDM then fails with an IndexError deep in diffusers), and the consistency schedulers (LCM, TCD)
    no more than the ``original_inference_steps`` they were distilled with."""
    limits = (
        ("timesteps it was trained on", scheduler_config.get("num_train_timesteps")),
        ("original inference steps (a consistency model)", scheduler_config.get("original_inference_steps")),
    )
    for what, limit in limits:
        if limit and steps > limit:
            raise RequestError(f"steps {steps} is more than this scheduler's {limit} {what}; ask for at most {limit}")


def clip_cuts(prompts: Sequence[str], tokenizers: dict[str, Any], t5: bool = False) -> list[str]:
    """A line for each prompt longer than the CLIP ``tokenizers`` (text encoder → its tokenizer) read: the pipelines
    cut it to their 77 tokens, and sdtrt's quiet loading hides diffusers' warning. ``t5``: a T5 encoder reads it all.
    """
    lines = []
    for prompt in dict.fromkeys(prompts):
        counts = {encoder: len(tokenizer(prompt).input_ids) for encoder, tokenizer in tokenizers.items()}
        cut = [encoder for encoder, count in counts.items() if count > tokenizers[encoder].model_max_length]
        if cut:
            limit = tokenizers[cut[0]].model_max_length
            verb = "sees" if len(cut) == 1 else "see"
            lines.append(
                f"the prompt {prompt[:30]!r}… is {counts[cut[0]]} CLIP tokens and CLIP reads {limit}: "
                f"{' and '.join(cut)} {verb} only its first {limit}" + ("; T5 reads all of it" if t5 else "")
            )
    return lines


def check_prompt_tokens(model: ModelSource, request: GenerateRequest, profile: ShapeProfile | None) -> None:
    """``check_t5_prompts`` before the pipeline loads, for models with T5 (SD3, Flux), or ``check_llm_prompts`` for
    FLUX.2's LLM: the engines' ``profile`` has the token range, and counting tokens needs only the model's tokenizer
    folder."""
    from ..core.families import LLM_TOKENS, T5_TOKENS, llm_system_message

    family = model.family()
    if family not in T5_TOKENS and family not in LLM_TOKENIZERS:
        return
    from transformers import AutoTokenizer

    built = profile is not None and profile.tokens is not None
    default = T5_TOKENS.get(family) or LLM_TOKENS[family]
    limit = profile.tokens.max if profile is not None and profile.tokens is not None else default
    folder = T5_TOKENIZERS.get(family) or LLM_TOKENIZERS[family]
    tokenizer = AutoTokenizer.from_pretrained(model.path / folder, local_files_only=True)
    prompts = [p for p in (request.prompt, request.negative_prompt) if p]
    if family in T5_TOKENS:
        return check_t5_prompts(prompts, tokenizer, limit, built)
    check_llm_prompts(prompts, tokenizer, limit, built, system=llm_system_message(model.pipeline_class()))


# T5's tokenizer folder: SD3's third text encoder, Flux's second.
T5_TOKENIZERS = {"sd3": "tokenizer_3", "flux": "tokenizer_2", "flux-schnell": "tokenizer_2"}
# An LLM text encoder's tokenizer folder (FLUX.2 [klein]'s Qwen).
LLM_TOKENIZERS = {"flux2": "tokenizer"}


def batch_kwargs(requests: Sequence[GenerateRequest], accepts: Collection[str]) -> dict[str, Any]:
    """Keyword arguments for one pipeline call that serves every request: one image each, in order.

    Text-to-image requests that share size, steps and guidance batch; prompts, negative prompts and
    generators become lists (diffusers draws each image's noise from its own generator, so an image
    depends on its seed, not on the batch it ran in). One request gives ``pipeline_kwargs`` unchanged.
    """
    each = [r.pipeline_kwargs(accepts) for r in requests]
    if len(each) == 1:
        return each[0]
    inputs = ("image", "mask_image", "ip_adapter_image", "control_image", "image_reference")  # each a request's own
    with_images = any(getattr(r, name) is not None for r in requests for name in inputs)
    if len({r.batch_key for r in requests}) > 1 or with_images or any(r.images != 1 for r in requests):
        raise RequestError("only text-to-image requests of one image that share size, steps and guidance batch")
    merged = each[0] | {"prompt": [k["prompt"] for k in each], "generator": [k["generator"] for k in each]}
    if any(r.negative_prompt is not None for r in requests):
        merged["negative_prompt"] = [r.negative_prompt or "" for r in requests]  # "" is what None means
    return merged


def check_size(height: int | None, width: int | None, multiple: int, profile: ShapeProfile | None) -> None:
    """RequestError for a given side off the model's grid (``multiple`` pixels) or, given the engines' profile, a
    size outside it (a side not given: the profile's optimum): validate's and debug's size rule. Cheap: run it
    before loading anything."""
    for name, value in (("height", height), ("width", width)):
        within = getattr(profile, name) if profile is not None else None
        if value is not None and (problem := grid_problem(name, value, multiple, within)):
            raise RequestError(problem)
    if profile is not None and (height is not None or width is not None):
        height = profile.height.opt if height is None else height
        width = profile.width.opt if width is None else width
        if problem := profile.size_problem(height, width):
            raise RequestError(problem)


def check_validation(config: ValidationConfig, rule: SizeRule, profile: ShapeProfile | None) -> None:
    """RequestError for what no validation can honour: a size off the model's grid or outside the engines'
    profile (in pixels), a tolerance no comparison can meet or miss. Cheap: run it before loading anything."""
    check_size(config.height, config.width, rule.multiple, profile)
    if config.min_cosine is not None and not -1.0 <= config.min_cosine <= 1.0:
        raise RequestError(f"minimum cosine {config.min_cosine} is outside -1..1, the range a cosine similarity has")
    if config.max_abs is not None and not config.max_abs >= 0:
        raise RequestError(f"maximum absolute error {config.max_abs} must be 0 or more")
    if config.min_psnr_db is not None and math.isnan(config.min_psnr_db):
        raise RequestError("minimum PSNR must be a number of dB, not NaN")
