"""Parity between an engine and the PyTorch fp32 reference: tensors, final latents and images.

A ValidationReport is truthy when every check passes and ``raise_for_status()`` raises ParityError
otherwise (the CLI exits 3). NaN/inf outputs and black or constant images always fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..core.artifact import Artifact
from ..core.config import QUANT_PRECISIONS, Precision, QuantPrecision, ValidationConfig, pixel_size
from ..core.errors import ParityError, StoreError
from ..core.stage_request import StageRequest, environment
from ..core.store import Store
from ..runtime.compare import tensor_stats
from ..spec import GraphSpec, LLMEncoderSpec, ValidationCase, denoiser_component, denoiser_spec
from .host_memory import HostMemory
from .image_quality import latent_psnr_db, psnr_db, ssim

if TYPE_CHECKING:
    from ..pipeline.request import GenerateRequest
    from ..runtime import Runtime
    from ..sources.ip_adapters import IPAdapterFiles
    from ..sources.models import ModelSource

STAGE = "validate"  # a stored report: keyed by the engine and the validation config
VERSION = 2  # 2: a quantized member is held to 8-bit tolerances
# What a member is held to: its graph's precision, or the 8-bit format its Q/DQ graph quantizes to.
HeldTo = Precision | QuantPrecision
REPORT = "report.json"
NOT_JSON = ("images", "stored_in")  # what a report holds for the HTML report only


def compare_case(runtime: Runtime, network: Any, spec: GraphSpec, case: ValidationCase) -> dict[str, Any]:
    """One seeded case through the engine and the fp32 PyTorch network (through the graph's own wrapper; an LLM's
    as transformers runs it, its own masks from the padding mask): the statistics of its worst output."""
    from ..stages.graph_module import graph_module
    from ..stages.llm_encoder import llm_reference

    feeds = spec.case_inputs(case)
    reference = llm_reference(network, spec) if isinstance(spec, LLMEncoderSpec) else graph_module(spec, network)
    with torch.no_grad():
        expected = reference(*(feeds[name] for name in spec.input_names))
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = runtime.run(feeds)
    rows = [
        tensor_stats(got[name], want) | {"output": name} for name, want in zip(spec.output_names, expected, strict=True)
    ]
    worst = min(rows, key=lambda row: row["cosine"] if row["finite"] else float("-inf"))
    return {"case": spec.case_label(case)} | worst


@dataclass(frozen=True)
class Tolerances:
    min_cosine: float
    max_abs: float
    min_psnr_db: float

    @classmethod
    def for_precision(cls, precision: HeldTo) -> Tolerances:
        if precision in QUANT_PRECISIONS:
            # What 8 bits give on the tiny presets' random weights (tests/test_quantize.py prints them per level):
            # the denoiser's output cosine against fp32 stays above 0.99 and the image PSNR above 20 dB, where a
            # broken scale gives noise.
            return cls(min_cosine=0.99, max_abs=0.5, min_psnr_db=20.0)
        if precision == "fp16":
            return cls(min_cosine=0.999, max_abs=0.05, min_psnr_db=30.0)
        if precision == "bf16":  # 8 bits of mantissa to fp16's 11: errors ~8x fp16's
            return cls(min_cosine=0.995, max_abs=0.4, min_psnr_db=24.0)
        return cls(min_cosine=0.99999, max_abs=1e-3, min_psnr_db=40.0)

    @classmethod
    def of(cls, config: ValidationConfig, precision: HeldTo) -> Tolerances:
        """The config's overrides over the defaults for the engine's precision."""
        base = cls.for_precision(precision)
        return cls(
            config.min_cosine if config.min_cosine is not None else base.min_cosine,
            config.max_abs if config.max_abs is not None else base.max_abs,
            config.min_psnr_db if config.min_psnr_db is not None else base.min_psnr_db,
        )


@dataclass
class ValidationReport:
    engine: str
    model: str
    precision: str
    tolerances: Tolerances
    tensors: list[dict[str, Any]] = field(default_factory=list)
    image: dict[str, Any] | None = None
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # cases projected over the host's memory: not compared
    members: list[str] = field(default_factory=list)  # the components compared
    # The compared images (``pytorch``, ``engine``: [H, W, 3] in [0, 1]), for the HTML report; not in the JSON, a
    # stored report keeps them as PNGs beside it (report_images.IMAGE_FILES).
    images: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    stored_in: Path | None = field(default=None, compare=False)  # the store's validate artifact holding it, if any

    def __bool__(self) -> bool:
        return not self.failures

    def raise_for_status(self) -> None:
        if self.failures:
            raise ParityError(
                f"engine does not match PyTorch: {self.failures[0]}"
                + (f" (+{len(self.failures) - 1} more)" if len(self.failures) > 1 else "")
                + "; rebuild it, or use --precision fp32 to see whether fp16 overflow is the cause"
            )

    def to_json(self) -> dict[str, Any]:
        data = asdict(replace(self, images={}))
        return {k: v for k, v in data.items() if k not in NOT_JSON} | {"passed": bool(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ValidationReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names} | {"tolerances": Tolerances(**data["tolerances"])})


def image_problems(image: np.ndarray) -> list[str]:
    """NaN/inf, all-black and constant images: what a broken fp16 engine typically produces."""
    if not np.isfinite(image).all():
        return ["contains NaN or inf"]
    problems = []
    if image.max() < 0.02:
        problems.append("is all black")
    elif image.std() < 1e-3:
        problems.append(f"is constant (std {image.std():.2g})")
    return problems


def tolerance_precision(artifact: Artifact, precision: Precision) -> HeldTo:
    """The precision an engine member is held to: a quantized graph's 8 bits (its graph is fp32 or fp16 outside
    the Q/DQ pairs); fp32 layers of a TensorRT engine built with TF32 multiply with TF32's 10-bit mantissa, as fp16
    does (BuilderFlag.TF32, pyCoreDoc.h), so fp32 tolerances would not say what it computes. sdtrt builds fp32
    graphs without TF32 unless --tf32 asks or compile made them fp32 for range (compile.upcast_tf32)."""
    from ..stages.build_trt import built_with_tf32
    from ..stages.quantize import quantization

    if quantized := quantization(artifact):
        return cast(QuantPrecision, quantized)
    if precision == "fp32" and any(a.stage == "build-trt" and built_with_tf32(a.manifest) for a in artifact.lineage()):
        return "fp16"
    return precision


def least_precise(precisions: Iterable[HeldTo]) -> HeldTo:
    """8 bits below bf16 below fp16 below fp32: what an image made by members of these precisions is held to."""
    return min(precisions, key=("int8", "fp8", "bf16", "fp16", "fp32").index, default="fp32")


def check_tensor_row(row: dict[str, Any], tol: Tolerances, what: str) -> list[str]:
    label = row["case"]
    if not row["finite"]:
        return [f"{what} output at {label} contains NaN or inf"]
    failures = []
    if row["cosine"] < tol.min_cosine:
        failures.append(f"{what} output at {label}: cosine {row['cosine']:.6f} < {tol.min_cosine}")
    if row["max_abs"] > tol.max_abs:
        failures.append(f"{what} output at {label}: max abs error {row['max_abs']:.3g} > {tol.max_abs}")
    return failures


def validate(
    model: ModelSource, engine: Artifact, config: ValidationConfig = ValidationConfig(),
    ip_adapter: IPAdapterFiles | None = None,
) -> ValidationReport:  # fmt: skip
    """Compare an engine — the model's denoiser, or each member of an engine set — with the model's PyTorch fp32
    networks (an IP-Adapter's loaded from ``ip_adapter``, the compile's files, else where the export recorded them).

    Tensors member by member, on the cases each member's spec gives (a denoiser's span the schedule's
    timesteps); then one generation with every engine swapped in at once against the PyTorch pipeline
    (without a VAE engine both images are decoded by the PyTorch VAE, to isolate the others).
    """
    from ..core.progress import step
    from ..pipeline.loading import engine_members, generate, load_pipeline, standins, with_components
    from ..pipeline.request import GenerateRequest, SizeRule, check_validation
    from ..runtime import check_weight_budget, open_members
    from ..stages.engine_set import check_pairing, engine_profile
    from ..stages.ip_adapter import reference_network
    from ..stages.quantize import precision_label

    members = engine_members(engine)
    check_pairing(members, model)
    built_for = engine_profile(members)
    check_validation(config, SizeRule.for_model(model), built_for)
    denoiser = denoiser_component(model)
    profile = built_for or denoiser_spec(model).default_profile()
    check_weight_budget(members.values(), config.weight_budget)
    runtimes = open_members(members, model, config.weight_budget)
    rule = SizeRule.for_model(model)
    request = GenerateRequest(
        prompt=config.prompt, steps=config.steps, guidance=rule.applicable(config.guidance), seed=config.seed,
        negative_prompt=" " if rule.guides_with_negative_prompt else None,  # Qwen-Image: its guided (two-pass) run
        height=config.height or profile.height.opt, width=config.width or profile.width.opt,
    ).sized_for(rule)  # fmt: skip
    reference = load_pipeline(model, scheduler=config.scheduler)
    request = with_input_images(request, reference)
    held_to = {c: tolerance_precision(members[c], r.spec.precision) for c, r in runtimes.items()}
    # The image is as close as its least precise member allows.
    tol = Tolerances.of(config, least_precise(held_to.values()))
    # A member is labelled by what it computes in: its graph's precision, or its 8-bit format, level and graphs.
    computes = {c: precision_label(members[c]) or r.spec.precision for c, r in runtimes.items()}
    alone = list(runtimes) == [denoiser]
    label = computes[denoiser] if alone else ", ".join(f"{c} {p}" for c, p in computes.items())
    report = ValidationReport(str(engine.path), model.name, label, tol, members=list(runtimes))
    for component, runtime in runtimes.items():
        spec, member_tol = runtime.spec, Tolerances.of(config, held_to[component])
        # A UNet's IP-Adapter is loaded into the reference's, then unloaded below: the images compare without one.
        network, loaded_adapter = reference_network(reference, model, component, members[component], ip_adapter)
        cases = spec.validation_cases(spec.member_profile(profile))
        # A set's rows name their member; a denoiser alone needs no name.
        prefix = "" if alone else f"{component} "
        memory = HostMemory(spec, config.memory_budget) if runtime.device.type == "cpu" else None
        with step(f"Comparing {spec.label} outputs on {len(cases)} inputs"):
            for case in cases:
                if memory and (why := memory.refusal(case)):
                    report.skipped.append(f"{prefix}{spec.case_label(case)}: {why}")
                    continue
                with memory.measuring(case, spec.case_label(case)) if memory else contextlib.nullcontext():
                    row = compare_case(runtime, network, spec, case)
                row["case"] = prefix + row["case"]
                row["failures"] = check_tensor_row(row, member_tol, spec.label)
                row["tolerance"] = {"min_cosine": member_tol.min_cosine, "max_abs": member_tol.max_abs}
                report.tensors.append(row)
                report.failures += row["failures"]
        if loaded_adapter:
            reference.unload_ip_adapter()

    if config.images:
        swapped = standins(model, members, reference.vae, reference.dtype, config.weight_budget, opened=runtimes)
        engine_pipe = with_components(reference, swapped)
        decoder = engine_pipe if "vae" in swapped else reference
        assert request.height and request.width  # sized_for set them
        with step(
            f"Generating with both pipelines ({config.steps} steps, {pixel_size(request.height, request.width)})"
        ):
            steps: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
            latents = [
                generate(p, request, output_type="latent", on_latents=_kept_in(kept)).images
                for p, kept in zip((reference, engine_pipe), steps, strict=True)
            ]
            images = [_decode(reference, latents[0], request), _decode(decoder, latents[1], request)]
        report.image = compare_images(images[1], images[0], latents[1], latents[0], tol)
        report.image["case"] = {
            "pipeline": type(reference).__name__, "scheduler": type(reference.scheduler).__name__,
            "steps": config.steps, "height": request.height, "width": request.width, "seed": config.seed,
        }  # fmt: skip
        report.image["drift"] = step_drift(steps[1], steps[0])
        report.images = {"pytorch": images[0][0], "engine": images[1][0]}
        report.failures += report.image["failures"]
    for runtime in runtimes.values():
        runtime.close()
    return report


def stored_validate(
    model: ModelSource, engine: Artifact, config: ValidationConfig, store: Store, revalidate: bool = False,
    ip_adapter: IPAdapterFiles | None = None,
) -> tuple[ValidationReport, bool]:  # fmt: skip
    """``validate``, reusing the report stored for this engine and config (second value: True) unless
    ``revalidate``. A new report is stored beside the engines (replacing the one run again), where the store is
    writable.

    The key is the engine's (which names the model's weights) plus the config and the reference's library
    versions: anything that could change the verdict.
    """
    request = StageRequest(
        STAGE, VERSION, config, [engine.as_input()], environment("torch", "diffusers", "transformers", "onnxruntime")
    )
    stored = store.lookup(request)
    intact = stored is not None and not stored.file_problems()
    if stored is not None and intact and not revalidate:
        from .report_images import load_images

        report = ValidationReport.from_json(json.loads((stored.path / REPORT).read_text()))
        return replace(report, images=load_images(stored.path), stored_in=stored.path), True
    report = validate(model, engine, config, ip_adapter)
    with contextlib.suppress(StoreError):  # a read-only store: the report is shown, not kept
        # Run again (revalidate), this run's report replaces the stored one: it is what later cache hits return.
        made, _ = store.produce(request, lambda out_dir: _store_report(report, engine, out_dir), rebuild=revalidate)
        report.stored_in = made.path
    return report, False


def _store_report(report: ValidationReport, engine: Artifact, out_dir: Path) -> dict[str, Any]:
    from .report_images import save_images

    (out_dir / REPORT).write_text(json.dumps(report.to_json(), indent=2))
    save_images(report.images, out_dir)
    return {"primary": REPORT, "passed": bool(report), "reproduce": f"sdtrt validate --engine {engine.path}"}


def with_input_images(request: GenerateRequest, pipe: Any) -> GenerateRequest:
    """The request with a seeded input image (and a mask, a control image) where the pipeline needs them: img2img,
    inpaint, refiner, FLUX.1 Fill, Canny / Depth (the image flipped: another structure) and Kontext (its reference)."""
    from PIL import Image

    needs = inspect.signature(pipe.__call__).parameters
    if "image" not in needs and "control_image" not in needs:
        return request
    assert request.height and request.width  # sized_for set them
    rng = np.random.default_rng(request.seed)
    ys, xs = np.mgrid[0 : request.height, 0 : request.width] / max(request.height, request.width)
    smooth = np.stack([ys, xs, 1 - (ys + xs) / 2], axis=-1)  # a gradient, so the image has structure
    pixels = np.clip(smooth + 0.1 * rng.standard_normal(smooth.shape), 0, 1)
    image = Image.fromarray((pixels * 255).astype(np.uint8))
    mask = None
    if "mask_image" in needs:
        box = np.zeros((request.height, request.width), np.uint8)
        box[request.height // 4 : 3 * request.height // 4, request.width // 4 : 3 * request.width // 4] = 255
        mask = Image.fromarray(box)
    control = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if "control_image" in needs else None
    return replace(request, image=image if "image" in needs else None, mask_image=mask, control_image=control)


def compare_images(
    image: np.ndarray,
    reference_image: np.ndarray,
    latents: torch.Tensor,
    reference_latents: torch.Tensor,
    tol: Tolerances,
) -> dict[str, Any]:
    psnr = psnr_db(image, reference_image)
    failures = [f"engine image {p}" for p in image_problems(image)]
    failures += [f"reference image {p} (the model itself is broken)" for p in image_problems(reference_image)]
    if psnr < tol.min_psnr_db:
        failures.append(f"image PSNR {psnr:.1f} dB < {tol.min_psnr_db} dB")
    return {
        "psnr_db": psnr,
        "ssim": ssim(image, reference_image),
        "latents": tensor_stats(latents, reference_latents),
        "shape": list(image.shape),
        "failures": failures,
    }


def _kept_in(kept: list[torch.Tensor]) -> Callable[[int, torch.Tensor], None]:
    """``generate``'s on_latents, keeping a copy of each step's latents (the scheduler may reuse the tensor)."""
    return lambda _, latents: kept.append(latents.clone())


def step_drift(latents: list[torch.Tensor], reference_latents: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The engine's latents against the reference's after each denoising step: where an error starts to grow."""
    return [
        {"step": index, "cosine": stats["cosine"], "psnr_db": latent_psnr_db(got, want), "max_abs": stats["max_abs"]}
        for index, (got, want) in enumerate(zip(latents, reference_latents, strict=True))
        if (stats := tensor_stats(got, want))
    ]


def _decode(pipe: Any, latents: torch.Tensor, request: GenerateRequest) -> np.ndarray:
    """Decode with the pipeline's VAE (the PyTorch one, where no VAE engine is compared), as the pipeline decodes:
    Flux's packed latents unpacked, SD3's and Flux's VAE shift undone; FLUX.2's latent output is what its VAE
    decodes already (klein undid its batch norm and patchification; Flux2Pipeline leaves both to be undone here, as
    it undoes them before decoding); Qwen-Image's unpacked to one frame and
    its per-channel statistics undone."""
    from diffusers import AutoencoderKLQwenImage  # its engine stand-in is one too

    config = pipe.vae.config
    if hasattr(pipe, "_unpack_latents"):  # FluxPipeline's output_type="latent" is packed 2×2
        latents = pipe._unpack_latents(latents, request.height, request.width, pipe.vae_scale_factor)
    elif hasattr(pipe, "_unpatchify_latents") and latents.ndim == 3:  # Flux2Pipeline's: a patch sequence, normalised
        rows, cols = (side // (pipe.vae_scale_factor * 2) for side in (request.height, request.width))
        latents = latents.transpose(1, 2).reshape(latents.shape[0], -1, rows, cols)
        norm = pipe.vae.bn
        std = torch.sqrt(norm.running_var.view(1, -1, 1, 1) + config.batch_norm_eps)
        latents = pipe._unpatchify_latents(latents * std + norm.running_mean.view(1, -1, 1, 1))
    shift = getattr(config, "shift_factor", None) or 0.0
    scale = getattr(config, "scaling_factor", None) or 1.0
    with torch.no_grad():
        if isinstance(pipe.vae, AutoencoderKLQwenImage):  # per-channel statistics (SDXL's may have some too), one frame
            stats = [torch.tensor(s).view(1, -1, 1, 1, 1) for s in (config.latents_std, config.latents_mean)]
            decoded = pipe.vae.decode(latents * stats[0] + stats[1], return_dict=False)[0][:, :, 0]  # type: ignore[attr-defined]
        else:
            decoded = pipe.vae.decode(latents / scale + shift, return_dict=False)[0]
    return pipe.image_processor.postprocess(decoded, output_type="np")
