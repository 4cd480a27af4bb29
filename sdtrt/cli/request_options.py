"""What a command that runs engines is asked for (`generate`, `client`, `profile`, `validate`, `serve`): the image's
options, LoRAs and the engines' weight-streaming budget, declared once; each checked before anything loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..core.artifact import Artifact
from ..core.config import WeightBudget
from ..core.errors import ConfigError, RequestError
from ..core.families import TASKS
from ..core.progress import console
from ..pipeline.request import FLOW_SCHEDULERS, SCHEDULERS

if TYPE_CHECKING:
    from ..core.config import ShapeProfile
    from ..core.families import Task
    from ..pipeline.request import GenerateRequest, SizeRule
    from ..pipeline.step_cache import StepCache
    from ..sources.models import ModelSource

HeightPxOpt = Annotated[int | None, typer.Option(help="Image height in pixels (default: the model's).")]
WidthPxOpt = Annotated[int | None, typer.Option(help="Image width in pixels (default: the model's).")]
# What to generate (`generate`, `client`).
PromptOpt = Annotated[str, typer.Option(help="What to draw.")]
NegativePromptOpt = Annotated[str | None, typer.Option(help="What to steer away from.")]
StepsOpt = Annotated[int, typer.Option(min=1, help="Denoising steps.")]
GuidanceOpt = Annotated[
    float | None,
    # No square brackets: rich reads them as markup and drops them from --help.
    typer.Option(
        help="Guidance scale (default: the pipeline's own, as diffusers has it: 7.5 SD, 5 SDXL, 7 SD3, 3.5 FLUX.1-dev, "
        "30 FLUX.1 Fill, 7 FLUX.1 control img2img / inpaint; FLUX.1-schnell takes none)."
    ),
]
LORA_METAVAR = "<FILE[:SCALE]>"
IMAGE_HELP = (
    "Input image (img2img, inpainting, SDXL refiner, FLUX.1 Fill), Qwen-Image-Edit's image to edit "
    "(required; Qwen-Image guides only with a --negative-prompt, ' ' will do), FLUX.1 Kontext's or FLUX.2 "
    "\\[klein]'s reference image, or an SD ControlNet txt2img pipeline's control image."
)
ImageOpt = Annotated[Path | None, typer.Option(help=IMAGE_HELP)]
ImagesOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--image",
        help=f"{IMAGE_HELP} Repeat it for Qwen-Image-Edit-2509's QwenImageEditPlusPipeline: 1 to 3 images.",
    ),
]
MaskOpt = Annotated[Path | None, typer.Option(help="Inpainting mask: white is repainted.")]
TaskOpt = Annotated[
    str | None,
    typer.Option(metavar=f"<{'|'.join(TASKS)}>", help="The pipeline of the model's family to run (default: its own)."),
]
ControlImageOpt = Annotated[
    Path | None,
    typer.Option(
        help="The control image (edges, depth, pose) of FLUX.1 Canny / Depth, of a FLUX.1 ControlNet set (every "
        "task) and of SD ControlNet img2img / inpaint, in the output's aspect ratio (SD ControlNet txt2img takes "
        "it as --image)."
    ),
]
ReferenceImageOpt = Annotated[
    Path | None,
    typer.Option(
        help="FLUX.1 Kontext and FLUX.2 [klein] inpainting (--task inpaint): the reference image its edit reads, "
        "apart from the --image it repaints (which is the reference without one; klein reads both); resized to "
        "Kontext's preferred resolution nearest its aspect ratio, klein's to at most 1024² px."
    ),
]
StrengthOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        max=1.0,
        help="How much of --image to repaint (default: the pipeline's own, as diffusers has it: "
        "0.8 SD img2img, 0.3 SDXL img2img, 0.6 Flux img2img / inpaint, 1.0 FLUX.1 Fill).",
    ),
]
SeedOpt = Annotated[int, typer.Option(help="Random seed, 0..2^64-1; the same seed gives the same image.")]
WeightBudgetOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SDTRT_WEIGHT_STREAMING_BUDGET",
        help="TensorRT engines built with --weight-streaming: GPU memory for the weights of each streaming engine "
        "(not shared across a set): auto (TensorRT's, from free memory), a percentage of its streamable weights "
        "(50%) or a size (8GiB, each); 0 streams the most (default: all on the GPU).",
    ),
]


CacheOpt = Annotated[
    str | None,
    typer.Option(
        metavar="<KIND[:VALUE]>",
        help="A step cache on the denoiser (engines compiled with --caches): first-block[:THRESHOLD] (diffusers' "
        "First-Block Cache, default 0.05; higher skips more), taylorseer[:INTERVAL] (TaylorSeer lite, a full step "
        "every INTERVAL, default 5), magcache[:THRESHOLD] (MagCache with diffusers' Flux ratios, default 0.06), "
        "deepcache[:INTERVAL] (a UNet's; a full step every INTERVAL, default 3), or auto[:KIND]: the setting `sdtrt "
        "calibrate-cache` stored for the engine set at these steps.",
    ),
]


FreeUOpt = Annotated[
    str | None,
    typer.Option(
        metavar="<S1,S2,B1,B2>",
        help="FreeU's four factors (a UNet's; e.g. SD 1.5's 0.9,0.2,1.5,1.6): engines need a set compiled with "
        "--freeu.",
    ),
]


def freeu_factors(text: str | None, engine: Artifact | None, model: ModelSource) -> tuple[float, ...] | None:
    """--freeu, parsed and checked against the model and the engines before anything loads (exit 2)."""
    from ..core.config.components import FREEU_MEMBER
    from ..spec import denoiser_component
    from ..stages.engine_set import engine_members

    if text is None:
        return None
    try:
        factors = tuple(float(f) for f in text.split(","))
    except ValueError:
        factors = ()
    if len(factors) != 4 or not all(math.isfinite(f) for f in factors):
        raise RequestError(f"--freeu {text}: give FreeU's four factors S1,S2,B1,B2, e.g. 0.9,0.2,1.5,1.6")
    if (denoiser := denoiser_component(model)) != "unet":
        raise RequestError(f"--freeu rescales a UNet's up blocks, and {model.name}'s denoiser is a {denoiser}")
    if engine is not None and FREEU_MEMBER not in engine_members(engine):
        raise RequestError(f"--freeu: {engine.path} has no FreeU build; compile the set with --freeu")
    return factors


def require_ip_adapter_engine(engine: Artifact | None) -> None:
    """--ip-adapter-image needs a denoiser engine compiled with the adapter: checked before anything loads (exit 2)."""
    from ..stages.engine_set import engine_members

    members = engine_members(engine) if engine is not None else {}
    denoiser = members.get("unet") or members.get("transformer")
    if denoiser is None or not (denoiser.manifest.get("io") or {}).get("ip_layers"):
        where = f"{engine.path} has no denoiser compiled with" if engine is not None else "a PyTorch pipeline loads no"
        raise RequestError(
            f"--ip-adapter-image: {where} IP-Adapter; compile an engine set with `sdtrt compile --ip-adapter PATH` and "
            "pass it as --engine"
        )


def step_cache(text: str | None) -> StepCache | None:
    """--cache, parsed before anything loads (exit 2 when malformed); ``auto`` is resolved later (resolve_cache)."""
    from ..pipeline.step_cache import StepCache

    if text is None or text == "auto" or text.startswith("auto:"):
        return None
    try:
        return StepCache.parse(text)
    except ConfigError as exc:
        raise RequestError(str(exc)) from None


def resolve_cache(
    text: str | None, engine: Artifact | None, model: ModelSource, steps: int, scheduler: str | None,
    from_image: bool = False,
) -> StepCache | None:  # fmt: skip
    """--cache, ``auto[:KIND]`` looked up (the calibration stored beside ``engine``), and checked against the model
    and the engines before anything loads: exit 2 for a cache that cannot run there."""
    from ..pipeline.step_cache import engines_problem, model_problem
    from ..stages.engine_set import engine_members

    cache = step_cache(text)
    if text is not None and cache is None:
        if engine is None:
            raise RequestError("--cache auto reads the calibration of an engine set: pass --engine")
        from ..core.errors import ArtifactNotFoundError
        from ..tools.cache_calibration import auto_cache

        kind = text.partition(":")[2] or None
        if kind is not None and (
            problem := model_problem(step_cache(kind) or StepCache.parse(kind), model, model.name)
        ):
            raise RequestError(problem)  # auto:KIND for a kind this model cannot run
        try:
            cache = auto_cache(engine, steps, scheduler, kind)
        except ArtifactNotFoundError as exc:
            raise RequestError(str(exc)) from None
        console.print(f"[dim]--cache {text}: {cache.label}, as calibrate-cache found it for these engines[/]")
    if cache is None:
        return None
    members = engine_members(engine) if engine is not None else None
    if problem := model_problem(cache, model, model.name, from_image) or engines_problem(cache, members, model):
        raise RequestError(problem)
    return cache


def weight_budget(text: str | None) -> WeightBudget | None:
    """--weight-streaming-budget, parsed before anything loads (exit 2 when malformed); load_pipeline and validate
    check that an engine takes it before loading a network."""
    try:
        return WeightBudget.parse(text) if text is not None else None
    except ConfigError as exc:
        raise RequestError(str(exc)) from None


def check_engine_size(profile: ShapeProfile | None, request: GenerateRequest, rule: SizeRule) -> None:
    """RequestError (exit 2) before anything loads when a sized request, or a reference image it edits from
    (FLUX.2 [klein]), is outside the engines' ``profile`` (None: no engines, or a profile with no sizes)."""
    from ..pipeline.references import check_references, request_references

    if profile is None or not (request.height and request.width):
        return
    if problem := profile.size_problem(request.height, request.width):
        raise RequestError(problem)
    if profile.references:
        check_references(request_references(request.image, request.image_reference), profile, rule.multiple)


def task_option(task: str | None) -> Task | None:
    """--task, checked before anything loads (exit 2 for one that is no task)."""
    if task is not None and task not in TASKS:
        raise RequestError(f"task '{task}' is not one of {', '.join(TASKS)}")
    return task


def checked_request(
    request: GenerateRequest, source: ModelSource, task: Task | None, artifact: Artifact | None
) -> GenerateRequest:
    """The request checked against the pipeline ``task`` picks (the images it takes and needs), sized as its input
    image where that pipeline takes no size, then by the model's rule and against the engines' profile: RequestError
    (exit 2) before anything loads (`generate`, `bench`, `profile`)."""
    from ..core.families import pipeline_class_name
    from ..pipeline.image_inputs import check_pipeline_inputs, sized_by_image
    from ..pipeline.request import SizeRule
    from ..stages.engine_set import engine_members, engine_profile

    rule, pipeline_class = SizeRule.for_model(source), source.pipeline_class()
    profile = engine_profile(engine_members(artifact)) if artifact else None
    check_pipeline_inputs(request, pipeline_class, task, rule)  # what the pipeline takes, then sizes (the Triton row's)
    request = sized_by_image(request, pipeline_class_name(pipeline_class, task), rule.multiple, profile).sized_for(rule)
    check_engine_size(profile, request, rule)
    return request


def open_image(path: Path | None, mode: str, option: str) -> Any:
    """--image or --mask, opened; one missing or unreadable is a usage error in one line (not Typer's box)."""
    if path is None:
        return None
    if not path.is_file():
        raise RequestError(f"{option} {path} {'is a directory' if path.is_dir() else 'does not exist'}; pass an image")
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(path).convert(mode)
    except (UnidentifiedImageError, OSError) as exc:
        raise RequestError(f"{option}: cannot read {path} as an image: {exc}") from exc


def open_images(paths: list[Path] | None, pipeline: str) -> Any:
    """--image, opened: None, one image, or the list of the several a ``pipeline`` (diffusers class) takes (the Edit
    Plus pipeline's, up to QWEN_EDIT_IMAGES); more than it takes is a usage error in one line, before any is read."""
    from ..core.families import QWEN_EDIT_IMAGES

    paths = paths or []
    most = QWEN_EDIT_IMAGES.get(pipeline, 1)
    if len(paths) > most:
        several = ", ".join(f"{name} takes up to {count}" for name, count in QWEN_EDIT_IMAGES.items() if count > 1)
        fix = f"pass at most {most}" if most > 1 else f"pass one ({several})"
        raise RequestError(f"{pipeline} takes {'at most ' if most > 1 else ''}{most} --image, not {len(paths)}: {fix}")
    images = [open_image(path, "RGB", "--image") for path in paths]
    return images if len(images) > 1 else next(iter(images), None)


def task_images(image: list[Path] | Path | None, mask: Path | None, pipeline: str = "") -> dict[str, Any]:
    """--image (one, or generate's repeated ones for the ``pipeline`` that takes several) and --mask opened, by
    GenerateRequest field (image, mask_image): generate, bench, profile, client."""
    paths = image if isinstance(image, list) else [image] if image else []
    return {"image": open_images(paths, pipeline), "mask_image": open_image(mask, "L", "--mask")}


def lora_options(values: list[str] | None) -> list[tuple[str, float]]:
    """``--lora FILE[:SCALE]`` options, checked before anything loads: a bad scale or a missing file is a
    usage error (exit 2); what is inside the file is checked where it is read."""
    from ..core.errors import LoraError
    from ..lora.files import parse_lora_option

    loras = []
    for value in values or []:
        try:
            path, scale = parse_lora_option(value)
        except LoraError as exc:
            raise RequestError(str(exc)) from None
        if not Path(path).exists():
            raise RequestError(f"--lora {value}: LoRA file {path} does not exist")
        loras.append((path, scale))
    return loras


def check_lora_families(loras: list[tuple[str, float]], source: ModelSource) -> None:
    """A LoRA whose names say it is for another family than the model's, refused from its header before anything
    loads (LoraFamilyError, exit 2)."""
    from ..lora.files import check_family

    for path, _ in loras:
        check_family(path, source.family())


SchedulerOpt = Annotated[
    str | None,
    typer.Option(
        metavar=f"<{'|'.join([*SCHEDULERS, *FLOW_SCHEDULERS])}>",
        help=f"Scheduler: {', '.join(SCHEDULERS)} for UNet models; {', '.join(FLOW_SCHEDULERS)} for SD3 / Flux "
        "(flow-heun: SD3 only). Default: the model's.",
    ),
]
