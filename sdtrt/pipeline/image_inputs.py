"""The images a request hands a pipeline — input image, mask, control image, Kontext's reference — checked against
what the pipeline takes, before any engine runs.

Light to import (no torch at import time), like request.py, whose GenerateRequest these checks serve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ..core.config import pixel_size
from ..core.errors import RequestError

if TYPE_CHECKING:
    from ..core.config import ShapeProfile
    from ..core.families import Task
    from .request import GenerateRequest, SizeRule

# How far a control image's aspect ratio may stray from the output's: diffusers resizes it to the output's size, so a
# proportional one (a 1024x1024 depth map for a 512x512 image) lines up; another would be stretched without a word.
ASPECT_TOLERANCE = 0.01

# What each image a pipeline may need is, in words, and the flag that passes it.
NEEDED = {
    "image": ("an input image", "--image"),
    "mask_image": ("a mask image", "--mask"),
    "control_image": ("a control image", "--control-image"),
}

# What to say to a control image, or a reference to inpaint by, given to a pipeline that takes none.
CONTROL_FIX = " (a FLUX.1 Canny / Depth model's pipeline takes one, as ControlNet img2img / inpaint pipelines do)"
REFERENCE_FIX = (
    " (--reference-image is FLUX.1 Kontext and FLUX.2 [klein] inpainting's: --task inpaint with an --image and a "
    "--mask; FLUX.1 Kontext's img2img, FLUX.2 [klein]'s txt2img and Qwen-Image-Edit read their reference or input "
    "image from --image)"
)
# A strength a pipeline would ignore (Qwen-Image-Edit's, Kontext's: they read an input image as tokens, no start).
STRENGTH_FIX = ": it draws the whole image, keeping none of an input image's noise-free start; leave --strength out"
# What to do about each input given to a pipeline that takes none (the image and mask's: the caller's image_fix).
UNTAKEN_FIXES = {"control_image": CONTROL_FIX, "image_reference": REFERENCE_FIX, "strength": STRENGTH_FIX}


def check_inputs(
    request: GenerateRequest,
    accepts: Collection[str],
    image_fix: str = "",
    image_optional: bool = False,
    task: Task | None = None,
    own: str = "",
) -> None:
    """RequestError for an input image or mask a pipeline whose ``__call__`` takes ``accepts`` needs and lacks, or
    for one it takes none of (``image_fix`` says what to do then); light: no torch. ``image_optional``: FLUX.1 Kontext
    (its __call__s alone take max_area; its inpainting one needs the image) and FLUX.2 [klein], whose reference
    images are optional (without one they generate from text). The refusal names the task that needs the image
    (``task``, else read from ``accepts``: only inpainting pipelines take a mask, only img2img and inpainting ones a
    strength); a txt2img one that needs an image (a ControlNet's), or one of no known task, is this model's own.
    ``own``: the pipeline class when ``task`` is the model's own, not one the user asked for (no --task given)."""
    task = task or ("inpaint" if "mask_image" in accepts else "img2img" if "strength" in accepts else None)
    needs = {None: "this model's pipeline needs", "txt2img": "this model's txt2img pipeline needs"}.get(
        task,
        f"this model's pipeline, {own} (an {task} one; no --task was given), needs" if own else f"--task {task} needs",
    )
    for name, (what, flag) in NEEDED.items():
        if name in accepts and getattr(request, name) is None and not (name == "image" and image_optional):
            raise RequestError(f"{needs} {what}: pass {flag}")
    for name in ("negative_prompt", "image", "mask_image", "control_image", "image_reference", "strength"):
        if getattr(request, name) is not None and name not in accepts:
            fix = image_fix if name in ("image", "mask_image") else UNTAKEN_FIXES.get(name, "")
            raise RequestError(f"this model's pipeline takes no {name.replace('_', ' ')}{fix}")


def fit_reference(request: GenerateRequest, rule: SizeRule, pipe: Any, inpaint: bool) -> GenerateRequest:
    """The request with FLUX.1 Kontext's reference resized as FluxKontextPipeline resizes it (_auto_resize): to the
    preferred resolution nearest its aspect ratio, scaled to the model's native size (diffusers' own at 1024 px).
    ``inpaint`` (FluxKontextInpaintPipeline): the image to repaint resized to the output's size, as the other
    inpainting pipelines resize theirs (with _auto_resize off it makes the output's size); its reference tokens are
    that image's, or those of its ``image_reference``, resized as a Kontext reference is. RequestError, before
    anything runs, where the engines' profile cannot take the tokens or the sizes."""
    from diffusers.image_processor import VaeImageProcessor

    image = one_reference(request.image)
    assert request.height and request.width  # sized_for set them
    if image is None and inpaint:
        return request  # the request's check_inputs says what is missing
    if not inpaint:
        size, tokens, image = kontext_reference(image, rule, pipe)
        check_reference_fits(pipe, request.height, request.width, rule.multiple, tokens, size, inpaint=False)
        return dataclasses.replace(request, image=image)
    image = VaeImageProcessor().resize(image, request.height, request.width)
    reference = one_reference(request.image_reference)
    if reference is None:  # the image to repaint is the reference too
        size = (request.height, request.width)
        tokens = (request.height // rule.multiple) * (request.width // rule.multiple)
    else:
        size, tokens, reference = kontext_reference(reference, rule, pipe)
    check_reference_fits(pipe, request.height, request.width, rule.multiple, tokens, size, reference is None)
    return dataclasses.replace(request, image=image, image_reference=reference)


def one_reference(image: Any) -> Any:
    """A request's Kontext reference (or image to repaint): one image, or None; RequestError for a list of others."""
    if not isinstance(image, list):
        return image
    if len(image) != 1:
        raise RequestError(f"FLUX.1 Kontext takes one reference image, not {len(image)}: pass one")
    return image[0]


def kontext_reference(image: Any, rule: SizeRule, pipe: Any) -> tuple[tuple[int, int] | None, int, Any]:
    """A Kontext reference's (height, width) once resized (None where it is not: no reference, or latents), its
    tokens, and the reference resized to the preferred resolution nearest its aspect ratio, as diffusers picks it."""
    import torch
    from diffusers.image_processor import VaeImageProcessor

    from ..spec.transformer import reference_sizes

    if image is None:  # text to image
        return None, 0, None
    if isinstance(image, torch.Tensor) and image.shape[-3] == pipe.vae.config.latent_channels:
        return None, (image.shape[-2] // 2) * (image.shape[-1] // 2), image  # latents: packed as they are
    height, width = image_size(image) or (0, 0)
    # diffusers' get_default_height_width rounds the sides down to the multiple before it reads the aspect ratio
    height, width = height - height % rule.multiple, width - width % rule.multiple
    preferred = reference_sizes(rule.default_height, rule.multiple)
    _, w, h = min((abs(width / height - w / h), w, h) for h, w in preferred)  # diffusers' pick, its ties too
    return (h, w), (h // rule.multiple) * (w // rule.multiple), VaeImageProcessor().resize(image, h, w)


def check_reference_fits(
    pipe: Any, height: int, width: int, multiple: int, tokens: int, size: tuple[int, int] | None, inpaint: bool
) -> None:
    """RequestError where the engine transformer's profile takes fewer or more tokens than a ``height`` x ``width``
    image and ``tokens`` of a reference resized to ``size`` (``inpaint``: the image to repaint), or the VAE encoder's
    not that size."""
    generated = (height // multiple) * (width // multiple)
    cause = f"the {pixel_size(height, width)} image is {generated} tokens" + (
        " and the image to inpaint, its reference, as many more"
        if inpaint
        else f" and its reference, resized to {pixel_size(*size)} (FLUX.1 Kontext's preferred resolution nearest its "
        f"aspect ratio), {tokens} more"
        if size
        else f" and its reference latents {tokens} more"
        if tokens
        else " (text to image: no reference)"
    )
    fix = "ask for another --height / --width, or rebuild the set with `sdtrt compile --height / --width` ranges wider"
    transformer = getattr(getattr(pipe.transformer, "runtime", None), "profile", None)
    if transformer is not None:
        low, _, high = (shape[1] for shape in pipe.transformer.spec.profile_shapes(transformer)["hidden_states"])
        if not low <= generated + tokens <= high:
            raise RequestError(f"{cause}: {generated + tokens} is outside the engines' {low}..{high}; {fix}")
    encoder = getattr(pipe.vae, "encoder_runtime", None)
    if size is not None and encoder is not None and encoder.profile is not None:
        low_shape, _, high_shape = next(iter(encoder.spec.profile_shapes(encoder.profile).values()))
        if not all(lo <= side <= hi for side, lo, hi in zip(size, low_shape[2:], high_shape[2:], strict=True)):
            raise RequestError(
                f"{cause}: the VAE encoder's profile takes {low_shape[3]}..{high_shape[3]} px wide and "
                f"{low_shape[2]}..{high_shape[2]} px high; {fix}"
            )


def image_size(image: Any) -> tuple[int, int] | None:
    """(height, width) of a PIL image, an HWC array or a CHW / BCHW tensor (a list's first); None for no image."""
    if isinstance(image, list):
        image = image[0] if image else None
    if image is None:
        return None
    if hasattr(image, "getbbox"):  # PIL
        return int(image.height), int(image.width)
    shape = [int(n) for n in image.shape]
    if type(image).__module__.startswith("torch") or len(shape) == 2:  # channels first, or a single channel
        return shape[-2], shape[-1]
    return shape[-3], shape[-2]


def check_control_image(control: Any, height: int, width: int) -> None:
    """RequestError for a control image whose aspect ratio is not the ``height`` x ``width`` output's."""
    size = image_size(control)
    if size is None or abs(size[0] * width - size[1] * height) <= ASPECT_TOLERANCE * size[0] * width:
        return
    raise RequestError(
        f"the control image is {pixel_size(*size)} and the image to generate {pixel_size(height, width)}, another "
        "aspect ratio: a control image (edges, depth, pose) lines up with the output pixel for pixel, and the pipeline "
        "would stretch it; pass one in the output's aspect ratio (any size: it is resized), or ask for a --height and "
        "--width in its ratio"
    )


def check_pipeline_inputs(request: GenerateRequest, index_class: str, task: Task | None, rule: SizeRule) -> None:
    """``check_inputs`` against the pipeline ``task`` picks in the family of ``index_class`` (the class
    model_index.json names), before diffusers is imported; an image or mask it takes none of is answered with the
    --task whose pipeline takes it. Then the control image's aspect ratio against the size ``rule`` gives."""
    from ..core.families import (
        REFERENCE_IMAGE_PIPELINES,
        REFERENCE_TOKEN_PIPELINES,
        family_tasks,
        pipeline_class_name,
        pipeline_inputs,
    )

    wanted: Task = "inpaint" if request.mask_image is not None else "img2img"
    row = family_tasks(index_class)
    if wanted in row:
        fix = f": pass --task {wanted}" + (" and an --image" if request.image is None else "")
    else:
        fix = f" (its family has no {wanted} pipeline; it has {', '.join(row)})" if row else ""
    pipeline = pipeline_class_name(index_class, task)
    optional = pipeline in REFERENCE_TOKEN_PIPELINES + REFERENCE_IMAGE_PIPELINES  # Kontext's, klein's reference
    named = task or next((each for each, name in row.items() if name == pipeline), None)  # the model's own task
    own = "" if task else pipeline
    check_inputs(request, pipeline_inputs(pipeline), fix, image_optional=optional, task=named, own=own)
    check_control_image(request.control_image, *rule.resolve(request.height, request.width))


# What a request carries besides its text and numbers that decides its task: the images a pipeline takes, strength.
TASK_INPUTS = ("image", "mask_image", "control_image", "image_reference", "strength")


def pick_task(request: GenerateRequest, tasks: dict[Task, str]) -> Task:
    """The first of ``tasks`` (task → pipeline class) whose pipeline takes every image and the strength ``request``
    carries and needs none it lacks: how a request without a --task (a Triton row) picks one. RequestError, saying
    what each task takes, when none fits."""
    from ..core.families import REFERENCE_IMAGE_PIPELINES, REFERENCE_TOKEN_PIPELINES, pipeline_inputs

    given = {name for name in TASK_INPUTS if getattr(request, name) is not None}
    takes = []
    for task, pipeline in tasks.items():
        accepts = pipeline_inputs(pipeline) & set(TASK_INPUTS)
        optional = {"strength", "image_reference"} | (
            {"image"} if pipeline in REFERENCE_TOKEN_PIPELINES + REFERENCE_IMAGE_PIPELINES else set()
        )
        needs = accepts - optional
        if needs <= given <= accepts:
            return task
        extra = sorted(accepts & optional)
        takes.append(
            f"{task} {'+'.join(sorted(needs)) or 'no image'}" + (f" (optional {'+'.join(extra)})" if extra else "")
        )
    raise RequestError(
        f"a request with {'+'.join(sorted(given)) or 'no image'} fits none of this model's tasks: {', '.join(takes)}"
    )


def control_map_as_image(request: GenerateRequest, tasks: dict[Task, str]) -> GenerateRequest:
    """On an SD / SDXL ControlNet set (``tasks``: task → pipeline class), a request whose only image is a control image
    with it as ``image``, the txt2img pipeline's name for the control map: so ``control_image`` names the control map in
    every family, as FLUX.1 Canny / Depth's, FLUX.1 ControlNet's and the ControlNet img2img / inpaint pipelines' do.
    Others unchanged."""
    given = [name for name in TASK_INPUTS if getattr(request, name) is not None]
    txt2img = tasks.get("txt2img", "")
    if given != ["control_image"] or "ControlNet" not in txt2img or txt2img.startswith("FluxControlNet"):
        return request
    return dataclasses.replace(request, image=request.control_image, control_image=None)


def sized_by_image(
    request: GenerateRequest, pipeline: str, multiple: int, profile: ShapeProfile | None = None
) -> GenerateRequest:
    """The request sized as its input image where the ``pipeline`` (diffusers class) makes the input's size (SD, SDXL
    and LCM img2img take no size; FLUX.2 [klein]'s inpainting one drops the one it is given for its image's, scaled and
    cut as it feeds it), so later checks see the size that runs; RequestError for an image off the model's
    ``multiple``-pixel grid or outside the engines' ``profile``, or a height / width asked that is not the image's
    (the pipeline would drop it without a word). Others unchanged. ``sdtrt generate`` and the Triton model both call
    this, before anything loads."""
    from ..core.config import grid_problem
    from ..core.families import QWEN_EDIT_VISION_AREA, pipeline_inputs

    size = image_size(request.image)
    fed = made_size(pipeline, request.image, multiple)
    if ("height" in pipeline_inputs(pipeline) and fed is None) or size is None:
        return request
    resized, size = fed not in (None, size), fed or size
    asked = {"height": request.height, "width": request.width}
    by_ratio = pipeline in QWEN_EDIT_VISION_AREA  # Qwen-Image-Edit inpainting: ~1024² px whatever the image's size
    made = (
        f"the pipeline makes {pixel_size(*size)} of the input image's aspect ratio (about 1024² px, whatever its size)"
        if by_ratio
        else f"the input image is {pixel_size(*size)}{' as the pipeline feeds it' if resized else ''}"
    )
    if any(side not in (None, makes) for side, makes in zip(asked.values(), size, strict=True)):
        given = " and ".join(f"{name} {side}" for name, side in asked.items() if side is not None)
        resize = "" if by_ratio else ", or resize the image"
        raise RequestError(
            f"{made}, not the {given} asked: diffusers' {pipeline} makes its output's size from its input image; "
            f"leave the height and width out{resize}"
        )
    problems = [grid_problem(name, value, multiple) for name, value in zip(("height", "width"), size, strict=True)]
    if profile is not None:
        problems.append(profile.size_problem(*size))
    if problem := next(filter(None, problems), None):
        if by_ratio:
            raise RequestError(
                f"{made}: {problem}; use an image nearer square, or a set compiled with --height / --width ranges "
                "that hold it"
            )
        raise RequestError(f"the input image, whose size the output takes, is {pixel_size(*size)}: {problem}")
    return dataclasses.replace(request, height=size[0], width=size[1])


# Pipelines that take a height and width but encode their image unresized (diffusers 0.42.1's ZImageImg2ImgPipeline
# preprocesses it at its own size and defaults the output's to it).
IMAGE_SIZED_PIPELINES = ("ZImageImg2ImgPipeline", "ZImageInpaintPipeline")


def made_size(pipeline: str, image: Any, multiple: int) -> tuple[int, int] | None:
    """(height, width) of the output a pipeline that takes a height, but makes its input image's size, makes of a PIL
    ``image``: FLUX.2 [klein] inpainting's (scaled down to 1024² px, cut to its grid), Qwen-Image-Edit inpainting's
    (its condition image's, ~1024² px at its aspect ratio), Z-Image img2img's and inpainting's (the image's own: given
    another size they fail in diffusers, the image's latents another shape than the noise's); None for others, or an
    image given as a tensor."""
    from ..core.families import INPAINT_REFERENCE_PIPELINES, QWEN_EDIT_VISION_AREA
    from ..spec.qwen_vision import condition_size
    from .references import fed_size

    if not hasattr(image, "getbbox"):
        return None
    if pipeline in INPAINT_REFERENCE_PIPELINES:
        return fed_size(image, multiple)
    if pipeline in IMAGE_SIZED_PIPELINES:
        return image.height, image.width
    if pipeline == "QwenImageEditInpaintPipeline":
        width, height = condition_size(QWEN_EDIT_VISION_AREA[pipeline], image.width / image.height)
        return height, width
    return None
