"""FreeU on UNet engines: the set's FreeU build (compile's freeu=True, ``unet_freeu``) takes FreeU's four factors as an
input and filters with real matmuls, checked against diffusers' fourier_filter, then run by ``pipe.enable_freeu`` in
engine pipelines of SD 1.x and SDXL on ONNX Runtime (fp32) against diffusers' PyTorch pipeline with the same factors;
and built as a TensorRT-RTX plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.utils.torch_utils import fourier_filter as diffusers_filter

from sdtrt import ConfigError, EngineInputError, ExportConfig, ShapeProfile, Store, ValidationConfig
from sdtrt.core.config.shapes import Range
from sdtrt.core.trt_products import rtx_missing
from sdtrt.pipeline.loading import engine_members, load_pipeline, set_loras
from sdtrt.sources.models import resolve_model
from sdtrt.stages.freeu import fourier_filter
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db

from .helpers import last_line, peft_lora, run_cli

PRESETS = ("tiny", "tiny-sdxl")
FACTORS = dict(s1=0.9, s2=0.2, b1=1.3, b2=1.4)  # FreeU's recommended SD 1.x / SDXL values
# Small, so that compiling and validating two engine sets stays quick; 80×112 px is on its grid (16 px) and gives the
# first up block odd, non-power-of-2 features (5×7 at the tiny UNets' two blocks).
PROFILE = ShapeProfile(Range(1, 1, 1), Range(64, 128, 128), Range(64, 128, 128))


@pytest.fixture(scope="module")
def freeu_set(tmp_path_factory):
    """preset → compile's result for its UNet with the FreeU build (fp32 ONNX Runtime); SD 1.x's members validated
    against PyTorch (no image comparison: the tests below compare images; SDXL's validation, the same code, is left to
    its images, to keep the file quick)."""
    store = Store(tmp_path_factory.mktemp("freeu-engines"))
    built = {}

    def get(preset: str):
        if preset not in built:
            validation = ValidationConfig(images=False) if preset == "tiny" else None
            built[preset] = compile_model(
                resolve_model(preset), store, "onnxruntime", ExportConfig(precision="fp32"), profile=PROFILE,
                components=("unet",), freeu=True, validation=validation,
            )  # fmt: skip
        return built[preset]

    return get


@pytest.mark.parametrize(("height", "width"), [(1, 1), (2, 3), (5, 7), (8, 8), (12, 10), (13, 16), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_matmul_filter_is_diffusers_fourier_filter(height, width, dtype):
    """Odd and even, power-of-2 or not, at each scale FreeU uses and at 1 (the identity, exactly): fp32 to within
    float rounding, fp16 (filtered in fp32 as diffusers does, then rounded) to within an fp16 rounding."""
    x = torch.randn(2, 3, height, width, generator=torch.Generator().manual_seed(height * width)).to(dtype)
    for scale in (0.2, 0.9, 1.6):
        want, got = diffusers_filter(x, threshold=1, scale=scale), fourier_filter(x, torch.tensor(scale))
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=2e-6 if dtype == torch.float32 else 4e-3, rtol=0)
    assert torch.equal(fourier_filter(x, torch.tensor(1.0)), x)


def test_compile_builds_and_validates_the_freeu_build(freeu_set):
    for preset in PRESETS:
        final = freeu_set(preset).final
        assert set(engine_members(final)) == {"unet", "unet_freeu"}
        assert final.manifest["reproduce"].endswith(" --freeu")
    report = freeu_set("tiny").validation
    assert report, report.failures
    assert {row["case"].split()[0] for row in report.tensors} == {"unet", "unet_freeu"}
    assert max(row["max_abs"] for row in report.tensors) < 1e-4


def generate(pipe, height: int = 128, width: int = 128) -> np.ndarray:
    return pipe(
        "a red fox in the snow", num_inference_steps=8, height=height, width=width, output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images[0]  # fmt: skip


@pytest.mark.parametrize("preset", PRESETS)
def test_engine_freeu_draws_the_pytorch_freeu_image_and_disable_gives_the_plain_one(freeu_set, preset):
    reference = load_pipeline(preset)
    reference.enable_freeu(**FACTORS)
    pipe = load_pipeline(preset, freeu_set(preset))
    sizes = ((128, 128), (80, 112))
    plain = {size: generate(pipe, *size) for size in sizes}
    assert pipe.unet.freeu_engine is None  # the FreeU build opens when FreeU is first enabled
    pipe.enable_freeu(**FACTORS)
    for size in sizes:
        image, want = generate(pipe, *size), generate(reference, *size)
        print(f"{preset} {size}: FreeU engine vs PyTorch {psnr_db(image, want):.1f} dB (plain engine vs PyTorch FreeU "
              f"{psnr_db(plain[size], want):.1f} dB)")  # fmt: skip
        # FreeU moves a tiny model's image little (the plain one is about 40 dB from it): the engine's is far closer.
        assert psnr_db(image, want) >= max(35, psnr_db(plain[size], want) + 30)
    pipe.disable_freeu()
    assert np.array_equal(generate(pipe), plain[sizes[0]])
    pipe.unet.enable_freeu(s1=0.0, **{k: v for k, v in FACTORS.items() if k != "s1"})  # a zero: diffusers' FreeU off
    assert np.array_equal(generate(pipe), plain[sizes[0]])


def test_freeu_is_refused_without_its_build_or_where_no_unet_takes_it(freeu_set, store):
    plain = load_pipeline("tiny", engine_members(freeu_set("tiny").final)["unet"])
    with pytest.raises(EngineInputError, match="no FreeU build: recompile it with `sdtrt compile --freeu`"):
        plain.enable_freeu(**FACTORS)
    off = load_pipeline("tiny", freeu_set("tiny"))
    off.enable_freeu(**FACTORS | {"s1": 0.0})  # a zero factor: FreeU off, as in diffusers
    assert off.unet.freeu is None and off.unet.freeu_engine is None  # the FreeU build did not open
    with pytest.raises(ConfigError, match="tiny-sd3's denoiser is a transformer"):
        compile_model(resolve_model("tiny-sd3"), store, "onnxruntime", freeu=True)
    done = run_cli("compile", "--model", "tiny-sd3", "--target", "onnxruntime", "--freeu")
    assert done.returncode == 2 and "compile without --freeu" in last_line(done.stderr)


def test_loras_go_into_the_freeu_build_as_into_the_unet(freeu_set, tmp_path):
    """Set before FreeU or while it is on: the FreeU build runs the UNet's LoRAs, as PyTorch's FreeU UNet runs its
    fused ones."""
    lora = peft_lora(resolve_model("tiny"), tmp_path, seed=1, rank=4, alpha=8)
    reference = load_pipeline("tiny", loras=[(lora, 0.7)])
    reference.enable_freeu(**FACTORS)
    want = generate(reference)
    for before in (True, False):
        pipe = load_pipeline("tiny", freeu_set("tiny"))
        if before:
            set_loras(pipe, [(lora, 0.7)])
        pipe.enable_freeu(**FACTORS)
        if not before:
            pipe.load_lora_weights(lora)
            pipe.set_adapters("default_0", 0.7)
        image = generate(pipe)
        print(f"FreeU + LoRA ({'set before' if before else 'loaded while on'}): {psnr_db(image, want):.1f} dB")
        assert psnr_db(image, want) >= 35
    pipe.disable_freeu()
    set_loras(pipe, [])
    assert psnr_db(generate(pipe), want) < 35  # the LoRA and FreeU both changed the image


@pytest.mark.skipif(bool(rtx_missing()), reason=f"builds TensorRT-RTX plans: {rtx_missing()}")
def test_the_freeu_build_builds_as_a_tensorrt_rtx_plan(store):
    """The fp16 graph, its filter built in the graph from the features' dynamic sizes, as a real TensorRT-RTX plan."""
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.stages import export, simplify
    from sdtrt.tools.compile import build

    model = resolve_model("tiny")
    graph = simplify.run(SimplifyConfig(), export.run(ExportConfig(component="unet_freeu"), model, store), store)
    plan, _ = build(graph, store, "tensorrt-rtx")
    assert plan.manifest["details"]["layer_types"].get("HALF"), plan.manifest["details"]["layers"]
    assert (plan.path / plan.manifest["primary"]).stat().st_size > 0


def test_generate_takes_freeu_factors_and_refuses_them_without_the_build(freeu_set, tmp_path):
    image, final, size = tmp_path / "freeu.png", freeu_set("tiny").final, ("--height", "128", "--width", "128")
    done = run_cli("generate", "--engine", str(final.path), "--freeu", "0.9,0.2,1.3,1.4", "--steps", "2", *size,
                   "--out", str(image))  # fmt: skip
    assert done.returncode == 0 and image.is_file(), done.stderr
    unet = str(engine_members(final)["unet"].path)
    refused = run_cli("generate", "--engine", unet, "--freeu", "0.9,0.2,1.3,1.4", *size)
    assert refused.returncode == 2 and "compile the set with --freeu" in last_line(refused.stderr)
    malformed = run_cli("generate", "--model", "tiny", "--freeu", "0.9,0.2")
    assert malformed.returncode == 2 and "four factors S1,S2,B1,B2" in last_line(malformed.stderr)
