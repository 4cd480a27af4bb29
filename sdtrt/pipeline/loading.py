"""Ready diffusers pipelines whose networks are engines: same class, same call, same images."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from functools import partial, wraps
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.markup import escape

from ..core.artifact import Artifact
from ..core.config import FREEU_MEMBER, IMAGE_ENCODER, TEXT_ENCODERS, TRANSFORMER_PARTS, UNET_PARTS, WeightBudget
from ..core.errors import ArtifactError
from ..core.families import INPAINT_REFERENCE_PIPELINES, REFERENCE_IMAGE_PIPELINES, Task, accepted, pipeline_class_name
from ..core.progress import console
from ..lora.files import LoraSpec
from ..lora.refit import EngineLoras, fuse_loras
from ..runtime import Runtime, check_weight_budget, open_members
from ..sources.models import ModelSource, load_folder, quiet_loading, resolve_model
from ..sources.qwen_processor import edit_processor
from ..spec import FOLDERS, FluxControlNetSpec, LLMEncoderSpec, T5EncoderSpec, model_components
from ..stages import weight_map as weight_maps
from ..stages.engine_set import engine_members as engine_members  # re-exported: callers know it from here
from ..standins.adapter_registry import apply_pipeline_loras, lora_networks
from ..standins.adapter_registry import forget as forget_adapters
from ..standins.base import EngineModule, refuse_pytorch_only, saved_engines
from ..standins.ip_adapter import IPAdapterInputs
from ..standins.text_encoders import EngineT5, EngineTextEncoder, final_layer_norm, text_encoder_config
from ..standins.unet import EngineUNet
from ..standins.vae import EngineVAE
from .image_inputs import fit_reference
from .references import check_pipeline_references, request_references
from .request import SCHEDULERS, GenerateRequest, SizeRule, batch_kwargs, check_scheduler, check_steps, clip_cuts
from .step_cache import cache_call_context
from .token_limits import clip_tokenizers, llm_kwargs, t5_kwargs

__all__ = [
    "SCHEDULERS", "GenerateRequest", "generate", "load_pipeline", "set_loras", "set_scheduler", "with_components"
]  # fmt: skip


class Built(Protocol):
    """What names the artifact a runtime loads: ``sdtrt.CompileResult`` does (its ``final``)."""

    @property
    def final(self) -> Artifact: ...


def set_scheduler(pipe: Any, name: str) -> None:
    import diffusers

    from ..core.families import transformer_family

    # Only whether the denoiser is a flow-matching transformer matters to the check: a UNet's family is left out.
    transformer = getattr(pipe, "transformer", None)
    family = "unet" if transformer is None else transformer_family(dict(transformer.config))
    scheduler = getattr(diffusers, check_scheduler(name, family, type(pipe).__name__))
    if type(pipe).__name__.startswith("LatentConsistencyModel"):
        scheduler = consistency_scheduler(scheduler)
    pipe.scheduler = scheduler.from_config(pipe.scheduler.config)


def consistency_scheduler(scheduler: Any) -> Any:
    """A consistency scheduler (check_scheduler: LCM or TCD) fit for the LatentConsistencyModel pipelines.

    They hand ``step`` eta=None (diffusers' pipeline_latent_consistency_text2img.py: prepare_extra_step_kwargs(
    generator, None)), which TCD cannot take: there None means TCD's own default eta.
    """
    takes_eta = inspect.signature(scheduler.step).parameters.get("eta")
    if takes_eta is None:
        return scheduler

    @wraps(scheduler.step)  # the pipeline reads step's signature to decide what to pass (generator, eta)
    def step(self: Any, *args: Any, eta: float | None = None, **kwargs: Any) -> Any:
        return scheduler.step(self, *args, eta=takes_eta.default if eta is None else eta, **kwargs)

    return type(scheduler.__name__, (scheduler,), {"step": step})


def load_pipeline(
    model: str | ModelSource,
    engine: str | os.PathLike[str] | Artifact | Built | None = None,
    *,
    scheduler: str | None = None,
    task: Task | None = None,
    dtype: torch.dtype = torch.float32,
    loras: Sequence[LoraSpec] = (),
    weight_budget: WeightBudget | str | None = None,
) -> Any:
    """The diffusers pipeline ``model_index.json`` names (or its family's ``task`` variant); with ``engine``,
    its networks run on engines.

    ``task`` picks txt2img, img2img or inpaint within the model's family (StableDiffusion…,
    StableDiffusionXL…, LatentConsistencyModel…). ``engine`` is an artifact directory (or file inside
    one) from ``sdtrt compile``/``build`` — a UNet engine or an engine set — an Artifact, or what
    ``compile_model`` returned. Components the engine (or set) lacks stay PyTorch (one line on stderr says which).
    Without ``engine`` the pipeline is plain PyTorch (the reference engines are checked against), unless
    ``model`` is a folder an engine pipeline was saved to (``pipe.save_pretrained``): then it runs on the
    engines recorded there again.
    ``loras``: (file, scale) pairs, put into the engines' weights (``set_loras``), or fused by diffusers
    into PyTorch networks when no network is an engine.
    ``weight_budget``: GPU memory for the weights of TensorRT engines built with weight streaming (``auto``,
    ``50%``, ``8GiB``; see sdtrt.core.config.WeightBudget); RequestError when no engine streams.
    The TensorRT members of one pipeline share one activation buffer (sdtrt.runtime.device_memory): never call two of
    its networks at the same time (two threads or streams); load a pipeline per thread.
    """
    import diffusers

    source = model if isinstance(model, ModelSource) else resolve_model(model)
    with quiet_loading():  # importing the pipelines makes transformers warn about torchvision
        cls = getattr(diffusers, pipeline_class_name(source.pipeline_class(), task))
    if engine is not None:
        members = engine_members(_as_artifact(engine))
    else:
        members = {c: Artifact.open(path) for c, path in saved_engines(source.path).items()}
    budget = WeightBudget.parse(weight_budget) if isinstance(weight_budget, str) else weight_budget
    check_weight_budget(members.values(), budget)
    # Skip loading what engines replace (3.4 GB for SD 1.5's UNet); diffusers type-checks components
    # given to from_pretrained, so the stand-ins go in through the constructor.
    skipped = {FOLDERS[c]: None for c in members if not (c == "vae_encoder" and "vae_decoder" not in members)}
    skipped |= edit_processor(cls.__name__, source.path)  # transformers makes none without torchvision
    no_checker = {"safety_checker": None, "requires_safety_checker": False}
    with quiet_loading():
        pipe = cls.from_pretrained(
            source.path, dtype=dtype, local_files_only=True, **accepted(cls, no_checker), **skipped
        )
    if members:
        pipe = with_components(pipe, standins(source, members, pipe.vae, dtype, budget))
        on_pytorch = [c for c in model_components(source) if c not in members]
        if on_pytorch and engine is not None:  # a saved pipeline's engines were chosen before
            where = "the engine set" if _as_artifact(engine).stage == "set" else f"the {', '.join(members)} engine"
            console.print(f"[dim]on PyTorch (not in {where}): {', '.join(on_pytorch)}[/]")
        refuse_pytorch_only(pipe)  # done by the constructor too; a pipeline without stand-ins keeps them
    if loras and lora_networks(pipe):
        set_loras(pipe, loras)
    elif loras:
        fuse_loras(pipe, loras)
    pipe.set_progress_bar_config(disable=True)
    if scheduler:
        set_scheduler(pipe, scheduler)
    return pipe


def set_loras(pipe: Any, loras: Sequence[LoraSpec]) -> None:
    """Put these (file, scale) LoRAs into every engine network of ``pipe``: UNet and text encoders alike. A scale is
    one number, or one per network (``{"unet": 0.8, "text_encoder": 0.4}``; 1.0 for a network it leaves out).

    Each weight is computed from the engine's base weights (any earlier set is undone); all files are
    checked before any engine changes, so LoraError leaves the pipeline as it was. ``[]`` clears them.
    Adapters loaded with diffusers' API (``pipe.load_lora_weights``) are forgotten: these LoRAs replace them.
    """
    apply_pipeline_loras(pipe, loras)
    forget_adapters(pipe)


def standins(
    source: ModelSource, members: dict[str, Artifact], vae: Any, dtype: torch.dtype,
    weight_budget: WeightBudget | None = None, opened: dict[str, Runtime] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The pipeline components that replace PyTorch modules: one stand-in per network (NETWORK_STANDINS), EngineVAE,
    and an IP-Adapter's image encoder where the UNet engine has one. ``opened``: runtimes of these members already
    open (validate's), so their weights are not loaded twice."""
    # A step cache's split members (and the FreeU build) open when a cache first runs: until then a set compiled with
    # caches loads and holds what one without them does (the transformer twice would be 24 GB more for Flux).
    split: dict[str, Artifact] = {
        c: a for c, a in members.items() if c in (*TRANSFORMER_PARTS, *UNET_PARTS, FREEU_MEMBER)
    }
    runtimes = open_members({c: a for c, a in members.items() if c not in split}, source, weight_budget, opened)
    out: dict[str, EngineModule] = {}

    def loras(member: str, network: str | None = None, runtime: Runtime | None = None) -> EngineLoras:
        """One member's LoRAs; a split member's (``runtime``) take the modules it holds of ``network``'s."""
        from ..spec.transformer_split import part_holds

        return EngineLoras(
            network or member, runtime or runtimes[member],
            partial(weight_maps.for_engine, members[member], source, network or member), family=source.family(),
            holds=partial(part_holds, member) if member in TRANSFORMER_PARTS else None,
            placed_only=member == "unet_shallow",  # DeepCache's deep member and the FreeU build are the whole UNet
        )  # fmt: skip

    def opener(names: Sequence[str]) -> Callable[[], dict[str, Runtime]]:
        return lambda: open_members({c: split[c] for c in names}, source, weight_budget, opened)

    for component, runtime in runtimes.items():
        if component in NETWORK_STANDINS:
            out[FOLDERS[component]] = NETWORK_STANDINS[component](source, component, runtime, dtype, loras)
    if "vision_encoder" in runtimes and "text_encoder" in out:  # Qwen-Image-Edit's tower: its LLM engine runs it
        from ..standins.qwen_vision import EngineQwen2_5_VisionTower

        vision = text_encoder_config(source).vision_config
        tower = EngineQwen2_5_VisionTower(runtimes["vision_encoder"], vision, dtype)
        out["text_encoder"].use_vision(tower)  # type: ignore[operator]  # EngineQwen2_5_VL's, beside the tower
    if parts := [c for c in TRANSFORMER_PARTS if c in split]:
        from ..standins.transformer import EngineTransformer

        transformer = out.get("transformer")
        if not isinstance(transformer, EngineTransformer):
            raise ArtifactError("the engine set holds a split transformer without its whole engine; recompile it")
        # where step caches run (standins/step_cache.py)
        transformer.use_parts(opener(parts), lambda member, runtime: loras(member, "transformer", runtime))
    unet_parts = [c for c in UNET_PARTS if c in split]
    if unet_parts or FREEU_MEMBER in split:
        unet = out.get("unet")
        if not isinstance(unet, EngineUNet):
            raise ArtifactError("the engine set holds DeepCache or FreeU members without the whole UNet engine; "
                                "recompile it")  # fmt: skip
        unet.use_members(  # where DeepCache (standins/deepcache.py) and FreeU (enable_freeu) run
            opener(unet_parts) if unet_parts else None,
            (lambda: opener([FREEU_MEMBER])()[FREEU_MEMBER]) if FREEU_MEMBER in split else None,
            lambda member, runtime: loras(member, "unet", runtime),
        )
    if "vae_decoder" in runtimes or "vae_encoder" in runtimes:
        out["vae"] = _vae(source, runtimes, (lambda: vae) if vae is not None else (lambda: load_folder(source, "vae")),
                          dtype)  # fmt: skip
    for folder, standin in out.items():  # what save_pretrained writes: the PyTorch files and the engines
        standin.model_folder = source.component_dir(folder)
        standin.engine_paths = {c: members[c].path for c in members if FOLDERS[c] == folder}
    denoiser = out.get("unet") or out.get("transformer")
    if isinstance(denoiser, IPAdapterInputs) and denoiser.spec.ip_layers:
        return out | ip_adapter_parts(source, denoiser, members, runtimes.get(IMAGE_ENCODER), dtype)
    return out


def ip_adapter_parts(
    source: ModelSource, denoiser: IPAdapterInputs, members: dict[str, Artifact], runtime: Runtime | None,
    dtype: torch.dtype,
) -> dict[str, Any]:  # fmt: skip
    """The image encoder of the IP-Adapter the denoiser engine was compiled with (its engine, or on PyTorch where the
    set has none), and a feature extractor where the model has none: the pipeline comes up as diffusers'
    load_ip_adapter leaves it."""
    from transformers import CLIPVisionConfig

    from ..stages.ip_adapter import recorded_ip_adapter
    from ..standins.image_encoder import EngineImageEncoder
    from ..standins.ip_adapter import feature_extractor_for

    if runtime is None:
        files = recorded_ip_adapter(members[denoiser.spec.component])
        assert files is not None  # the engine's spec has IP-Adapter layers: its export recorded the adapter
        console.print("[dim]on PyTorch (not in the engine set): the IP-Adapter's image encoder[/]")
        encoder: Any = files.load_image_encoder(dtype)
    else:  # the engine's config is in its export manifest: the adapter's files are not needed
        member = members[IMAGE_ENCODER]
        export = next(a for a in member.lineage() if a.stage == "export")
        encoder = EngineImageEncoder(runtime, CLIPVisionConfig(**export.manifest["details"]["config"]), dtype)
        folder = Path(export.manifest["inputs"][0]["path"])  # what save_pretrained copies, where it still is
        encoder.model_folder, encoder.engine_paths = (folder if folder.is_dir() else None), {IMAGE_ENCODER: member.path}
    denoiser.ip_image_encoder = lambda: encoder
    parts: dict[str, Any] = {"image_encoder": encoder}
    if not (source.path / "feature_extractor").is_dir():
        parts["feature_extractor"] = feature_extractor_for(encoder)
    return parts


def _vae(source: ModelSource, runtimes: dict[str, Runtime], pytorch: Callable[[], Any], dtype: torch.dtype) -> Any:
    """EngineVAE, or FLUX.2's EngineFlux2VAE with the latent statistics its pipelines read, or Qwen-Image's
    single-frame EngineQwenImageVAE."""
    config = source.component_config("vae")
    halves = (config, runtimes.get("vae_decoder"), runtimes.get("vae_encoder"))
    if config.get("_class_name") == "AutoencoderKLFlux2":
        from ..standins.vae_flux2 import EngineFlux2VAE, latent_batch_norm

        norm = latent_batch_norm(source.component_dir("vae"), config)
        return EngineFlux2VAE(*halves, pytorch=pytorch, dtype=dtype, latent_norm=norm)
    if config.get("_class_name") == "AutoencoderKLQwenImage":
        from ..standins.vae_qwen import EngineQwenImageVAE

        return EngineQwenImageVAE(*halves, pytorch=pytorch, dtype=dtype)
    return EngineVAE(*halves, pytorch=pytorch, dtype=dtype)


StandIn = Callable[[ModelSource, str, Runtime, torch.dtype, Callable[[str], EngineLoras]], EngineModule]


def _unet(source: ModelSource, component: str, runtime: Runtime, dtype: torch.dtype, loras: Any) -> EngineModule:
    return EngineUNet(runtime, source.unet_config(), dtype=dtype, loras=loras(component))


def _transformer(source: ModelSource, component: str, runtime: Runtime, dtype: torch.dtype, loras: Any) -> EngineModule:
    from ..standins.transformer import EngineTransformer

    return EngineTransformer(runtime, source.component_config(FOLDERS[component]), dtype=dtype, loras=loras(component))


def _controlnet(source: ModelSource, component: str, runtime: Runtime, dtype: torch.dtype, _: Any) -> EngineModule:
    """SD's and SDXL's ControlNetModel stand-in, or FLUX.1's FluxControlNetModel one, by the engine's graph."""
    from ..standins.controlnet import EngineControlNet
    from ..standins.controlnet_flux import EngineFluxControlNet

    standin = EngineFluxControlNet if isinstance(runtime.spec, FluxControlNetSpec) else EngineControlNet
    return standin(runtime, source.component_config(FOLDERS[component]), dtype=dtype)


def _text_encoder(
    source: ModelSource, component: str, runtime: Runtime, dtype: torch.dtype, loras: Any
) -> EngineModule:
    """CLIP's stand-in, or T5's where the engine is T5 (SD3's text_encoder_3, Flux's text_encoder_2), or the LLM's
    (FLUX.2's and Z-Image's Qwen3, Qwen-Image's Qwen2.5-VL)."""
    config = text_encoder_config(source, FOLDERS[component])
    if isinstance(runtime.spec, T5EncoderSpec):
        return EngineT5(runtime, config, dtype=dtype)
    if isinstance(runtime.spec, LLMEncoderSpec):
        from ..standins.llm_encoder import EngineLLMEncoder

        return EngineLLMEncoder(runtime, config, dtype=dtype)
    norm = final_layer_norm(source, config, FOLDERS[component])
    return EngineTextEncoder(runtime, config, norm, dtype=dtype, loras=loras(component))


# Engine component → its stand-in (the VAE's two halves make one EngineVAE, above). A new network is a row.
NETWORK_STANDINS: dict[str, StandIn] = {
    "unet": _unet, "transformer": _transformer, "controlnet": _controlnet,
    **dict.fromkeys(TEXT_ENCODERS, _text_encoder),
}  # fmt: skip


def _as_artifact(engine: str | os.PathLike[str] | Artifact | Built) -> Artifact:
    if isinstance(engine, Artifact):
        return engine
    if isinstance(engine, str | os.PathLike):
        return Artifact.open(Path(engine))
    return engine.final


def with_components(pipe: Any, replacements: dict[str, Any]) -> Any:
    """The same pipeline (shared components) with some components replaced.

    Built through the constructor, not by assigning ``pipe.unet``: pipelines derive state from
    their components' configs in ``__init__`` (e.g. whether ``sample_size`` is an int).
    """
    # Settings registered beside the components (requires_aesthetics_score, force_zeros_for_empty_prompt, …).
    settings = accepted(type(pipe), {k: v for k, v in pipe.config.items() if k not in pipe.components})
    replaced = type(pipe)(**pipe.components | replacements, **settings)
    replaced.set_progress_bar_config(disable=True)
    return replaced


def task_pipelines(pipe: Any, tasks: dict[Task, str]) -> dict[Task, Any]:
    """A pipeline per task of ``tasks`` (task → diffusers class): ``pipe`` for its own class, for the others one over
    the same components (engines and PyTorch networks shared, not copied). ``from_pipe`` casts those shared components
    in place to the dtype it is given, fp32 by default: given none, it would turn an fp16 load (a GPU's) into fp32,
    its PyTorch weights then taking twice the memory; so it is given ``pipe``'s."""
    import diffusers

    pipes = {}
    for task, cls in tasks.items():
        pipes[task] = pipe if type(pipe).__name__ == cls else getattr(diffusers, cls).from_pipe(pipe, dtype=pipe.dtype)
        pipes[task].set_progress_bar_config(disable=True)
    return pipes


def generate(
    pipe: Any,
    request: GenerateRequest | Sequence[GenerateRequest],
    on_step: Callable[[int, int], None] | None = None,
    output_type: str = "pil",
    on_latents: Callable[[int, torch.Tensor], None] | None = None,
) -> Any:
    """Run the pipeline once; ``on_step(step_index, total_steps)`` is called after every denoising step,
    ``on_latents(step_index, latents)`` with the latents it left (validate's drift over steps).

    Several text-to-image requests that share size, steps and guidance run as one batch, an image
    each, in order (``batch_kwargs``). The total comes from the scheduler: some (PNDM) run more UNet
    steps than ``request.steps``.
    """

    def callback(_pipe: Any, step: int, _t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if on_step is not None:
            on_step(step, len(_pipe.scheduler.timesteps))
        if on_latents is not None:
            on_latents(step, kwargs["latents"])
        return kwargs

    rule = SizeRule.for_pipeline(pipe)
    requests = [request] if isinstance(request, GenerateRequest) else request
    for each in requests:
        check_steps(each.steps, pipe.scheduler.config)
    accepts = set(inspect.signature(pipe.__call__).parameters)
    if type(pipe).__name__ in REFERENCE_IMAGE_PIPELINES + INPAINT_REFERENCE_PIPELINES:  # FLUX.2 [klein]
        for each in requests:
            check_pipeline_references(pipe, request_references(each.image, each.image_reference))
        if type(pipe).__name__ in REFERENCE_IMAGE_PIPELINES and all(r.image is None for r in requests):
            accepts.discard("image")  # optional there: reference images to edit from
    sized = [r.sized_for(rule) for r in requests]
    if "max_area" in accepts:  # FLUX.1 Kontext
        sized = [fit_reference(r, rule, pipe, inpaint="mask_image" in accepts) for r in sized]
    kwargs = batch_kwargs(sized, accepts)
    if rule.guidance_keyword in accepts and "guidance_scale" in kwargs:  # Qwen-Image: true_cfg_scale
        kwargs[rule.guidance_keyword] = kwargs.pop("guidance_scale")
    prompts = [p for r in requests for p in (r.prompt, r.negative_prompt) if p]
    kwargs |= t5_kwargs(pipe, prompts) | llm_kwargs(pipe, prompts, kwargs.get("image"))
    for line in clip_cuts(prompts, clip_tokenizers(pipe), t5="max_sequence_length" in kwargs):
        console.print(f"[yellow]![/] {escape(line)}")
    with torch.no_grad(), cache_call_context(pipe, kwargs):  # a step cache in a pipeline that opens no context
        return pipe(**kwargs, output_type=output_type, callback_on_step_end=callback)
