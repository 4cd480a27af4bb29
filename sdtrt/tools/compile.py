"""The whole chain for one model and target.

onnxruntime:  export → simplify → build-ort          (per component)
tensorrt:     export → simplify → build-trt → wrap  (per component; one-profile engines are wrapped)
tensorrt-rtx: export → simplify → build-trt         (per component; TensorRT-RTX plans, built without a GPU)
then, for several components, set: one artifact over their engines.
Each stage is a cache hit when nothing it depends on changed; validation runs on the final artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core.artifact import Artifact
from ..core.config import (
    FREEU_MEMBER,
    IMAGE_ENCODER,
    STEP_CACHES,
    Component,
    ConcreteTarget,
    ExportConfig,
    OrtBuildConfig,
    OrtOptimization,
    Precision,
    QuantizeConfig,
    ShapeProfile,
    SimplifyConfig,
    Target,
    TrtBuildConfig,
    ValidationConfig,
    WrapConfig,
    target_precision_problem,
)
from ..core.errors import ConfigError, MissingDependencyError, RequestError
from ..core.gpu import (
    require_quantization_support,
    require_refit_support,
    require_tensorrt,
    tensorrt_missing,
    torch_tensorrt_missing,
)
from ..core.store import Store
from ..core.trt_products import rtx_gpu_problem, rtx_missing, rtx_runtime_missing, rtx_turing_problem
from ..graph.onnx_graph import artifact_spec
from ..sources.ip_adapters import IPAdapterFiles, ip_adapter_files
from ..sources.models import ModelSource
from ..spec import (
    FOLDERS,
    FluxTransformerSpec,
    UNetSpec,
    denoiser_component,
    denoiser_spec,
    folder_architecture,
    model_components,
    spec_class,
)
from ..spec.transformer import TRANSFORMER_KINDS
from ..stages import build_ort, engine_set, export, quantize, simplify
from ..stages.engine_set import EngineSetConfig
from .validate import ValidationReport, stored_validate


@dataclass(frozen=True)
class CompileResult:
    """Every artifact the chain produced, in order; ``final`` is what a runtime loads."""

    target: ConcreteTarget
    target_reason: str
    artifacts: list[Artifact] = field(default_factory=list)
    validation: ValidationReport | None = None
    validation_cached: bool = False  # the report stored with these engines, not a new run
    # What validation could not check here, in one line (TensorRT-RTX plans on a machine without an RTX GPU).
    validation_note: str | None = None

    @property
    def final(self) -> Artifact:
        return self.artifacts[-1]


def resolve_target(target: Target) -> tuple[ConcreteTarget, str]:
    """The concrete target and a sentence saying why it was chosen."""
    missing = tensorrt_missing()
    if target == "auto":
        if missing is None:
            return "tensorrt", "auto: a CUDA GPU and TensorRT are present"
        return "onnxruntime", f"auto: {missing}, so the ONNX Runtime target was chosen"
    if target == "tensorrt":
        require_tensorrt()
        return "tensorrt", "tensorrt: requested"
    if target == "tensorrt-rtx":
        if missing := rtx_missing():
            raise MissingDependencyError(f"cannot build TensorRT-RTX plans here: {missing}")
        return (
            "tensorrt-rtx",
            "tensorrt-rtx: requested (plans built ahead of time, finished on the GPU that loads them)",
        )
    return "onnxruntime", "onnxruntime: requested"


def build(
    source: Artifact,
    store: Store,
    target: Target = "auto",
    profile: ShapeProfile | None = None,
    ort_optimization: OrtOptimization = "extended",
    trt_config: TrtBuildConfig | None = None,
) -> tuple[Artifact, str]:
    """Build an engine for ``target`` from an ONNX artifact; returns it and why that target was used.

    ``trt_config`` (TensorRT) carries its own profiles; otherwise ``profile`` (default: the model's).
    """
    chosen, reason = resolve_target(target)
    spec = artifact_spec(source)
    if problem := target_precision_problem(chosen, spec.precision):
        raise ConfigError(problem)
    profile = profile or spec.default_profile()
    if chosen in ("tensorrt", "tensorrt-rtx"):
        from ..stages import build_trt

        config = replace(trt_config or TrtBuildConfig(profiles=(profile,)), product=chosen)
        return build_trt.run(config, source, store), reason
    return build_ort.run(OrtBuildConfig(profile=profile, optimization=ort_optimization), source, store), reason


def compile_model(
    model: ModelSource,
    store: Store,
    target: Target = "auto",
    export_config: ExportConfig = ExportConfig(),
    simplify_config: SimplifyConfig = SimplifyConfig(),
    profile: ShapeProfile | None = None,
    trt_config: TrtBuildConfig | None = None,
    validation: ValidationConfig | None = None,
    components: tuple[Component, ...] | None = None,
    revalidate: bool = False,
    quantize_config: QuantizeConfig | None = None,
    caches: tuple[str, ...] | str = (),
    freeu: bool = False,
) -> CompileResult:
    """Run the chain for each component; with ``validation``, check the result against PyTorch (not raising).

    One component gives its engine; several give an engine set over them (for TensorRT the TorchScript
    wraps, or the plans when ``trt_config.refittable``: LoRAs refit plans). ``components`` defaults to
    every one the model has. Precision comes from ``export_config``, except for a VAE that asks to be
    upcast: fp32. The validation report stored for the final artifact and config is reused unless
    ``revalidate``. ``quantize_config``: the denoiser is quantized (INT8/FP8 Q/DQ graph) instead of exported,
    and validated to quantization's tolerances where ``validation`` leaves them open. ``caches``: step caches
    (STEP_CACHES: "first-block", "magcache", "taylorseer" for a transformer, "deepcache" for a UNet) whose split
    members join the set, so that ``pipe.transformer.enable_cache(config)`` / ``sdtrt.DeepCache(pipe).enable()`` run
    on the engines. ``freeu``: the UNet with FreeU's factors as an input joins the set (``unet_freeu``), so that
    ``pipe.enable_freeu(s1=…, s2=…, b1=…, b2=…)`` runs on the engines.
    """
    chosen, reason = resolve_target(target)  # fails before exporting when the target cannot be built here
    if problem := target_precision_problem(chosen, export_config.precision):
        raise ConfigError(problem)
    if chosen == "tensorrt":  # before the exports, or a minute of calibration, not after
        from ..stages import build_trt

        precisions = {export_config.precision}
        if quantize_config is not None:
            require_quantization_support(quantize_config.precision)
            precisions.add(
                quantize.tensorrt_precision(model)
            )  # the denoiser's TensorRT graph: a quantized Flux's is bf16
        for precision in sorted(precisions):
            build_trt.require_graph_precision(precision)
        if trt_config is not None and trt_config.refittable:
            require_refit_support()
    if chosen == "tensorrt-rtx" and trt_config is not None:  # before any export: a Turing plan of an fp32 graph
        for component in components or model_components(model):
            precision = component_precision(model, component, export_config.precision, chosen)
            if problem := rtx_turing_problem(precision, trt_config.compute_capabilities):
                raise RequestError(f"cannot build the {component} as a TensorRT-RTX plan: {problem}")
    unwrapped = wrap_problem(trt_config or TrtBuildConfig(), torch_tensorrt_missing()) if chosen == "tensorrt" else None
    if unwrapped:
        reason += f"; {unwrapped}"  # known before any plan is built
    wraps = chosen == "tensorrt" and unwrapped is None
    caches = (caches,) if isinstance(caches, str) else caches  # caches="first-block" means one, not its letters
    components = components or model_components(model)
    check_ip_adapter(model, export_config, caches, freeu, quantize_config)
    # The members beside run with the whole engine; an IP-Adapter goes into it.
    if (caches or freeu or export_config.ip_adapter) and denoiser_component(model) not in components:
        components = (*components, denoiser_component(model))
    # The members beside the denoiser: a step cache's split, the FreeU build, an IP-Adapter's image encoder.
    adapter = (IMAGE_ENCODER,) if export_config.ip_adapter else ()
    beside = (*cache_members(model, caches), *freeu_member(model, freeu), *adapter)
    components = (*components, *beside)
    # One user profile for every member: the denoiser's.
    profile = profile or denoiser_spec(model).default_profile()
    if chosen in ("tensorrt", "tensorrt-rtx"):
        trt_config = trt_config or TrtBuildConfig(profiles=(profile,))
    # The members beside the denoiser are cut from its calibrated network: the same scales (one calibration).
    quantized = {} if quantize_config is None else quantize.run_members(quantize_config, model, store, beside)
    artifacts: list[Artifact] = []
    finals: dict[str, Artifact] = {}
    graphs: dict[str, Artifact] = {}
    for component in components:
        precision = component_precision(model, component, export_config.precision, chosen)
        config = replace(export_config, component=component, precision=precision)
        if component not in ("unet", "transformer", IMAGE_ENCODER):  # the adapter goes into these only
            config = replace(config, ip_adapter="", ip_adapter_image_encoder="")
        exported = quantized[component] if component in quantized else export.run(config, model, store)
        simplified = simplify.run(simplify_config, exported, store)
        graphs[component] = simplified
        member = export.spec_for(model, config).member_profile  # Qwen-Image's LLM: its template's dropped tokens more
        member_trt = trt_config and upcast_tf32(trt_config, export_config.precision, config.precision)
        member_trt = member_trt and replace(member_trt, profiles=tuple(map(member, member_trt.profiles)))
        built, _ = build(simplified, store, chosen, member(profile), trt_config=member_trt)
        artifacts += [exported, simplified, built]
        if wraps:
            from ..stages import wrap

            artifacts.append(wrap.run(WrapConfig(), built, store))
        # A wrapped engine cannot be refit: a refittable build's set holds the plans, LoRAs' way in.
        finals[component] = built if trt_config is not None and trt_config.refittable else artifacts[-1]
    if len(components) > 1:
        artifacts.append(engine_set.run(EngineSetConfig(components), finals, store, model))
    if validation is None:
        return CompileResult(chosen, reason, artifacts)
    # PyTorch's side loads the adapter from the files this compile names (the engines' record may name a moved one).
    files = ip_adapter_files(export_config) if export_config.ip_adapter else None
    # On a GPU that runs them the plans validate as TensorRT's do; elsewhere the graphs they were built from.
    if chosen == "tensorrt-rtx" and (why := rtx_cannot_run(artifacts)):
        result = CompileResult(chosen, reason, artifacts)
        return validate_graphs(
            result, model, EngineSetConfig(components), graphs, validation, store, revalidate, why, files
        )
    report, cached = stored_validate(model, artifacts[-1], validation, store, revalidate, files)
    return CompileResult(chosen, reason, artifacts, report, cached)


# Denoiser → (what it is, for people; the step caches that fit it).
CACHE_KINDS = {
    "unet": ("UNet", "--caches deepcache (DeepCache skips a UNet's deep blocks)"),
    "transformer": ("transformer", "--caches first-block, magcache or taylorseer (they skip a transformer's blocks)"),
}


def cache_members(model: ModelSource, caches: tuple[str, ...]) -> tuple[Component, ...]:
    """The split members these step caches need (none without caches); ConfigError for a cache this model cannot
    take, before anything is exported."""
    from ..spec import unet_split
    from ..spec.transformer_split import split_problem

    if unknown := [c for c in caches if c not in STEP_CACHES]:
        raise ConfigError(f"unknown step cache {unknown[0]!r}; sdtrt builds {', '.join(STEP_CACHES)}")
    if not caches:
        return ()
    denoiser = denoiser_component(model)
    if wrong := [c for c in caches if FOLDERS[STEP_CACHES[c][0]] != denoiser]:
        what, fits = CACHE_KINDS[denoiser]
        raise ConfigError(f"{', '.join(wrong)} cannot run on {model.name}: its denoiser is a {what}; use {fits}")
    if denoiser == "unet":
        problem = unet_split.split_problem(model.unet_config(), model.has("controlnet"))
    else:
        problem = split_problem(model.component_config("transformer"), model.has("controlnet"), caches)
    if problem:
        raise ConfigError(f"cannot split {model.name}'s {denoiser} for step caches: {problem}")
    return tuple(dict.fromkeys(m for c in caches for m in STEP_CACHES[c]))


def freeu_member(model: ModelSource, freeu: bool) -> tuple[Component, ...]:
    """The FreeU build compile adds (none unless ``freeu``); ConfigError where this model cannot take it, before
    anything is exported."""
    if not freeu:
        return ()
    if (denoiser := denoiser_component(model)) != "unet":
        raise ConfigError(f"FreeU rescales a UNet's up blocks, and {model.name}'s denoiser is a {denoiser}: compile "
                          "without --freeu")  # fmt: skip
    return (FREEU_MEMBER,)


def check_ip_adapter(
    model: ModelSource, export_config: ExportConfig, caches: tuple[str, ...], freeu: bool,
    quantize_config: QuantizeConfig | None,
) -> None:  # fmt: skip
    """ConfigError where the IP-Adapter (export_config.ip_adapter) cannot go into this model's engines, before
    anything is exported; its files are read here too."""
    if not export_config.ip_adapter:
        return
    if not isinstance(denoiser_spec(model), UNetSpec | FluxTransformerSpec):
        raise ConfigError(
            f"IP-Adapter on {model.name}'s transformer engines is not built yet (a UNet's and Flux's are): compile "
            "without --ip-adapter, and run it on PyTorch (load_pipeline without an engine)"
        )
    if model.has("controlnet"):
        raise ConfigError("IP-Adapter with a ControlNet is not built yet: compile without --ip-adapter")
    family = model.family()
    if family.startswith(("sd2", "sdxl-refiner")) or "inpaint" in family:  # h94 publish none; not tested
        raise ConfigError(f"IP-Adapter on {family} engines is not built yet (SD 1.x's, SDXL's and Flux's are): compile "
                          "without --ip-adapter, and run it on PyTorch (load_pipeline without an engine)")  # fmt: skip
    if caches or freeu or quantize_config is not None:
        what = "step caches' members" if caches else "the FreeU build" if freeu else "a quantized UNet"
        raise ConfigError(f"IP-Adapter goes into the whole denoiser only, and {what} would run without it: compile "
                          "without --ip-adapter, or without the other")  # fmt: skip
    if export_config.weights == "stream":
        raise ConfigError(
            "an IP-Adapter goes into a loaded denoiser (as diffusers loads it), not a streamed one: compile with "
            "--weights load or auto (a loaded Flux.1 needs about 24 GiB of host memory in bf16)"
        )
    files = ip_adapter_files(export_config)
    if misfit := files.misfit(model):
        raise ConfigError(f"--ip-adapter {files.weights} does not fit {model.name}: {misfit}")


def validate_graphs(
    result: CompileResult,
    model: ModelSource,
    set_config: EngineSetConfig,
    graphs: dict[str, Artifact],
    validation: ValidationConfig,
    store: Store,
    revalidate: bool,
    why: str,
    ip_adapter: IPAdapterFiles | None = None,
) -> CompileResult:
    """TensorRT-RTX plans finish compiling on the GPU that loads them, so where none runs them (``why``) the graphs
    they were built from are validated against PyTorch on ONNX Runtime (as a set of their own when there are several;
    bf16 graphs, which ONNX Runtime cannot run, are not), and the result says in one line where the plans validate."""
    later = (
        f"the TensorRT-RTX plans cannot run here ({why}): they validate on the first RTX GPU that runs them, "
        f"`sdtrt validate --engine {result.final.path}` there"
    )
    if any(target_precision_problem("onnxruntime", artifact_spec(g).precision) for g in graphs.values()):
        return replace(
            result, validation_note=f"bf16 graphs do not run on ONNX Runtime, so nothing was compared here; {later}"
        )
    checked = engine_set.run(set_config, graphs, store, model) if len(graphs) > 1 else next(iter(graphs.values()))
    report, cached = stored_validate(model, checked, validation, store, revalidate, ip_adapter)
    note = f"validated here: the graphs the plans were built from, on ONNX Runtime ({checked.path}); {later}"
    return replace(result, validation=report, validation_cached=cached, validation_note=note)


def rtx_cannot_run(artifacts: list[Artifact]) -> str | None:
    """Why the TensorRT-RTX plans among ``artifacts`` cannot run on this machine, or None when every one can."""
    if missing := rtx_runtime_missing():
        return missing
    plans = (a for a in artifacts if a.stage == "build-trt")
    return next((problem for plan in plans if (problem := rtx_gpu_problem(plan.manifest["details"]))), None)


def wrap_problem(config: TrtBuildConfig, torch_tensorrt_missing: str | None) -> str | None:
    """Why the TensorRT engines will not be wrapped as TorchScript, or None when they will be."""
    if torch_tensorrt_missing:
        return f"{torch_tensorrt_missing}, so the engines are not wrapped as TorchScript: use the build-trt artifacts"
    if (profiles := len(config.effective_profiles())) > 1:
        return (
            f"the engines have {profiles} optimization profiles, so they are not wrapped as TorchScript "
            "(a wrapped engine runs profile 0 only): use the build-trt artifacts"
        )
    if config.strip_weights:  # Torch-TensorRT deserializes the plan itself: nothing would refill its weights
        return (
            "the engines hold no weights (--strip-weights), so they are not wrapped as TorchScript (a wrapped engine "
            "is never refilled from its graph): use the build-trt artifacts"
        )
    if config.weight_streaming:  # Torch-TensorRT sets the automatic budget itself (TRTEngine.cpp v2.6.0)
        return (
            "the engines stream their weights, so they are not wrapped as TorchScript (not offered yet: a wrapped "
            "engine would stream with TensorRT's automatic budget and sdtrt has no way to pass one): use the "
            "build-trt artifacts"
        )
    return None


def upcast_tf32(config: TrtBuildConfig, requested: Precision, precision: Precision) -> TrtBuildConfig:
    """The build settings of a member exported in ``precision`` when ``requested`` was asked: a graph made fp32 for
    range (an upcast VAE, T5) keeps TF32 unless --no-tf32 says otherwise, as NVIDIA's demo builds its fp32 SDXL VAE
    with tf32=True (demo/Diffusion stable_diffusion_pipeline.py); only an fp32 the user asked for computes in fp32."""
    if config.tf32 is None and precision == "fp32" and requested != "fp32":
        return replace(config, tf32=True)
    return config


def component_precision(
    model: ModelSource, component: str, requested: Precision, target: str = "onnxruntime"
) -> Precision:
    """fp32 for a VAE that asks to be upcast (fp16 VAEs overflow into black images); for networks whose class
    overflows fp16 (T5, an LLM, Qwen-Image's transformer: the spec of the folder's class says why; the export
    manifest records it), its ``fp16_fallback`` where ``target`` runs it (bf16), else fp32; else ``requested``."""
    if component.startswith("vae") and model.component_config("vae").get("force_upcast", True):
        return "fp32"
    architecture = folder_architecture(model, component)
    # A transformer's kind (Qwen-Image's overflows fp16), where the component's row dispatches on the class.
    spec = TRANSFORMER_KINDS.get(architecture) or spec_class(component, architecture)
    if requested == "fp16" and spec.fp16_problem:
        return "fp32" if _unbuildable(spec.fp16_fallback, target) else spec.fp16_fallback
    return requested


def _unbuildable(precision: Precision, target: str) -> bool:
    """Whether ``target`` cannot build or run graphs of ``precision`` here (bf16 on ONNX Runtime, or before Ampere)."""
    if target_precision_problem(target, precision):
        return True
    if target != "tensorrt" or precision != "bf16":
        return False
    from ..core.gpu import gpu_environment
    from ..stages.build_trt import graph_precision_problem

    return graph_precision_problem(precision, **gpu_environment()) is not None
