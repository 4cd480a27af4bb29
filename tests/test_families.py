"""Model families (issue 11): SD 2.x, SDXL base and refiner, inpainting, LCM — each end to end on tiny presets.

Every family is compiled to an ONNX Runtime engine set, loaded into the family's own diffusers
pipeline and compared with the PyTorch fp32 pipeline under two schedulers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import generate, load_pipeline
from sdtrt.pipeline.request import GenerateRequest
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import resolve_model
from sdtrt.spec import component_spec, model_components
from sdtrt.standins.text_encoders import EngineTextEncoder
from sdtrt.standins.unet import EngineUNet
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db
from sdtrt.tools.validate import with_input_images

from .helpers import last_line, run_cli, softmax_input_types

# preset → (family, pipeline class, components, UNet inputs beyond sample/timestep/encoder_hidden_states)
FAMILIES = {
    "tiny-sd2": ("sd2-v", "StableDiffusionPipeline", 4, ()),
    "tiny-inpaint": ("sd1-inpaint", "StableDiffusionInpaintPipeline", 4, ()),
    "tiny-lcm": ("sd1-lcm", "LatentConsistencyModelPipeline", 4, ("timestep_cond",)),
    "tiny-sdxl": ("sdxl", "StableDiffusionXLPipeline", 5, ("text_embeds", "time_ids")),
    "tiny-sdxl-refiner": ("sdxl-refiner", "StableDiffusionXLImg2ImgPipeline", 4, ("text_embeds", "time_ids")),
    "tiny-controlnet": ("sd1-controlnet", "StableDiffusionControlNetPipeline", 5,
                        (*(f"down_block_res_{i}" for i in range(4)), "mid_block_res")),
    "tiny-sdxl-controlnet": ("sdxl-controlnet", "StableDiffusionXLControlNetPipeline", 6,
                             ("text_embeds", "time_ids", *(f"down_block_res_{i}" for i in range(4)), "mid_block_res")),
}  # fmt: skip
SCHEDULERS = {"tiny-sd2": ("ddim", "euler"), "tiny-inpaint": ("pndm", "dpm++"), "tiny-lcm": ("lcm", "tcd"),
              "tiny-sdxl": ("euler", "dpm++"), "tiny-sdxl-refiner": ("euler", "ddim"),
              "tiny-controlnet": ("pndm", "euler-a"), "tiny-sdxl-controlnet": ("euler", "dpm++")}  # fmt: skip


@pytest.fixture(scope="module")
def family_sets(store):
    """preset → its engine set (ONNX Runtime, fp16; VAEs fp32 as force_upcast asks), compiled on first use."""
    built: dict[str, object] = {}

    def get(preset: str):
        if preset not in built:
            built[preset] = compile_model(resolve_model(preset), store, target="onnxruntime").final
        return built[preset]

    return get


@pytest.mark.parametrize("preset", FAMILIES)
def test_the_family_is_read_from_the_configs(preset):
    family, pipeline, components, extras = FAMILIES[preset]
    model = resolve_model(preset)
    assert (model.family(), model.pipeline_class(), len(model_components(model))) == (family, pipeline, components)
    spec = component_spec(model, "unet")
    assert spec.input_names[3:] == extras
    if "time_ids" in extras:  # SDXL base takes 6 time ids, the refiner 5 (aesthetic score)
        assert spec.time_ids_dim == (5 if "refiner" in preset else 6)


@pytest.mark.parametrize(("preset", "scheduler"), [(p, s) for p, pair in SCHEDULERS.items() for s in pair])
def test_the_family_pipeline_on_engines_matches_pytorch(family_sets, preset, scheduler):
    model = resolve_model(preset)
    reference = load_pipeline(model, scheduler=scheduler)
    engine = load_pipeline(model, family_sets(preset), scheduler=scheduler)
    assert type(engine).__name__ == FAMILIES[preset][1] and isinstance(engine.unet, EngineUNet)
    for name in ("text_encoder", "text_encoder_2"):
        if model.has(name):
            assert isinstance(getattr(engine, name), EngineTextEncoder), name
    request = with_input_images(GenerateRequest("a lighthouse", steps=4, seed=3, height=128, width=128), reference)
    images = [generate(pipe, request, output_type="np").images[0] for pipe in (reference, engine)]
    psnr = psnr_db(images[1], images[0])
    print(f"{preset} {scheduler}: PSNR {psnr:.1f} dB")
    assert images[0].shape == (128, 128, 3) and float(np.std(images[0])) > 0.01
    assert psnr >= 35.0


def test_sd2_fp16_graph_keeps_attention_in_fp32(family_sets, tiny_engine):
    """SD 2.x sets upcast_attention (fp16 attention overflows to NaN on its weights): softmax must run in fp32."""
    from sdtrt.stages.engine_set import members

    def simplified(engine) -> Path:
        return engine.lineage()[1].primary

    assert softmax_input_types(simplified(members(family_sets("tiny-sd2"))["unet"])) == {onnx.TensorProto.FLOAT}
    assert softmax_input_types(simplified(tiny_engine)) == {onnx.TensorProto.FLOAT16}, "SD 1.x (no upcast): fp16"


def test_an_sdxl_engine_refuses_a_call_without_its_conditioning(family_sets):
    model = resolve_model("tiny-sdxl")
    pipe = load_pipeline(model, family_sets("tiny-sdxl"))
    with pytest.raises(
        EngineInputError, match=r"takes text_embeds, time_ids beyond .* needs \['text_embeds', 'time_ids'\]"
    ):
        pipe.unet(torch.randn(2, 4, 16, 16), 10, torch.randn(2, 77, 64))


def test_pipelines_say_what_they_need(tiny):
    inpaint = load_pipeline(resolve_model("tiny-inpaint"))
    with pytest.raises(RequestError, match="needs an input image: pass --image"):
        generate(inpaint, GenerateRequest(steps=1, height=64, width=64))
    lcm = load_pipeline(resolve_model("tiny-lcm"))
    with pytest.raises(RequestError, match="takes no negative prompt"):
        generate(lcm, GenerateRequest(negative_prompt="blurry", steps=1, height=64, width=64))
    with pytest.raises(RequestError, match="step only with lcm or tcd, not euler"):
        load_pipeline(resolve_model("tiny-lcm"), scheduler="euler")


def test_cli_inpaints_with_a_mask_and_lists_the_family(family_sets, store, tmp_path):
    """The engine set alone names its model: --model defaults to the one the set was made from."""
    from PIL import Image

    engines = family_sets("tiny-inpaint")
    Image.new("RGB", (128, 128), (200, 120, 40)).save(tmp_path / "photo.png")
    Image.new("L", (128, 128), 255).save(tmp_path / "mask.png")
    out = tmp_path / "out.png"
    result = run_cli(
        "generate", "--engine", str(engines.path), "--image", str(tmp_path / "photo.png"), "--mask",
        str(tmp_path / "mask.png"), "--steps", "2", "--height", "128", "--width", "128", "--out", str(out), check=True,
    )  # fmt: skip
    assert last_line(result.stdout) == str(out) and Image.open(out).size == (128, 128)
    listing = run_cli("cache", "ls", "--engines", str(store.root), check=True).stdout
    sets = [line for line in listing.splitlines() if line.startswith("set ")]
    assert any(" sd1-inpaint " in line for line in sets), listing


def test_the_tensorrt_build_profiles_every_sdxl_input(family_sets, tmp_path):
    """The TensorRT worker gets min/opt/max shapes for the added conditioning too (built on GPUs only)."""
    from sdtrt.core.config import Range, ShapeProfile, TrtBuildConfig
    from sdtrt.stages import build_trt
    from sdtrt.stages.engine_set import members

    simplified = members(family_sets("tiny-sdxl"))["unet"].lineage()[1]
    profile = ShapeProfile(Range(1, 1, 2), Range(128, 256, 384), Range(128, 256, 384))
    (shapes,) = build_trt.worker_request(TrtBuildConfig(profiles=(profile,)), simplified, tmp_path)["profiles"]
    assert list(shapes) == ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
    assert shapes["text_embeds"] == [[1, 32], [2, 32], [4, 32]] and shapes["time_ids"] == [[1, 6], [2, 6], [4, 6]]


# ---- ControlNet -----------------------------------------------------------------------------------------------------


def test_a_controlnet_unet_engine_takes_zeros_without_a_controlnet_and_residuals_with_one(family_sets):
    from sdtrt.stages.engine_set import members

    model = resolve_model("tiny-controlnet")
    reference = load_pipeline(model)
    unet = EngineUNet(open_runtime(members(family_sets("tiny-controlnet"))["unet"], model), model.unet_config())
    gen = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 16, 16, generator=gen), torch.randn(2, 77, 32, generator=gen)
    residuals = tuple(torch.randn(2, c, 16 // k, 16 // k, generator=gen) for c, k in unet.spec.residuals)
    with torch.no_grad():
        for kwargs in (
            {},
            {"down_block_additional_residuals": residuals[:-1], "mid_block_additional_residual": residuals[-1]},
        ):
            got, want = unet(sample, 500, text, **kwargs).sample, reference.unet(sample, 500, text, **kwargs).sample
            assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999, list(kwargs)
    with pytest.raises(EngineInputError, match="takes 4 down-block residuals and a mid-block one; got 3"):
        unet(
            sample,
            500,
            text,
            down_block_additional_residuals=residuals[:3],
            mid_block_additional_residual=residuals[-1],
        )


def test_two_controlnets_sum_their_residuals_as_diffusers_does(family_sets):
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    from sdtrt.pipeline.loading import with_components

    model = resolve_model("tiny-controlnet")
    reference, engine = load_pipeline(model), load_pipeline(model, family_sets("tiny-controlnet"))
    reference = with_components(reference, {"controlnet": MultiControlNetModel([reference.controlnet] * 2)})
    engine = with_components(engine, {"controlnet": MultiControlNetModel([engine.controlnet] * 2)})
    request = with_input_images(GenerateRequest("a lighthouse", steps=4, seed=5, height=128, width=128), reference)
    kwargs = dict(image=[request.image, request.image.transpose(0)], controlnet_conditioning_scale=[1.0, 0.5])
    images = [
        pipe("a lighthouse", num_inference_steps=4, height=128, width=128, output_type="np",
             generator=torch.Generator().manual_seed(5), **kwargs).images[0]
        for pipe in (reference, engine)
    ]  # fmt: skip
    assert psnr_db(images[1], images[0]) >= 35.0


@pytest.mark.parametrize(
    ("task", "scheduler", "guidance", "steps"),
    [(None, "euler-a", 0.0, 1), ("inpaint", "euler", 5.0, 4)],
    ids=["turbo-style-no-guidance", "sdxl-inpaint"],
)
def test_the_sdxl_set_serves_turbo_style_calls_and_the_inpaint_pipeline(family_sets, task, scheduler, guidance, steps):
    """SDXL Turbo runs the base architecture without guidance (UNet batch 1); SDXL inpainting reuses the set."""
    model = resolve_model("tiny-sdxl")
    reference = load_pipeline(model, scheduler=scheduler, task=task)
    engine = load_pipeline(model, family_sets("tiny-sdxl"), scheduler=scheduler, task=task)
    assert type(engine).__name__ == type(reference).__name__
    request = GenerateRequest("a fox", steps=steps, guidance=guidance, seed=2, height=128, width=128)
    request = with_input_images(request, reference)
    images = [generate(pipe, request, output_type="np").images[0] for pipe in (reference, engine)]
    assert psnr_db(images[1], images[0]) >= 35.0


def test_triton_serves_a_controlnet_set_its_control_image_picking_the_task(family_sets, tmp_path):
    """Deployed (it was refused while Triton's rows carried no image), a ControlNet set's Triton model takes the control
    map as `control_image` (txt2img; `image` alone too, as `sdtrt generate --image`), with an `image` img2img."""
    from PIL import Image

    from . import triton_backend

    model, engine = resolve_model("tiny-controlnet"), family_sets("tiny-controlnet")
    rng = np.random.default_rng(1)
    edges, photo = (rng.integers(0, 256, (128, 128, 3), dtype=np.uint8) for _ in range(2))
    numbers = {"steps": 2, "seed": 4, "height": 128, "width": 128}
    with triton_backend.served(engine, tmp_path) as served:
        control, both, alone, strong = served.execute([
            triton_backend.row("a lighthouse", **numbers, image=edges),
            triton_backend.row("a lighthouse", **numbers, image=photo, control_image=edges),
            triton_backend.row("a lighthouse", **numbers, control_image=edges),
            triton_backend.row("a lighthouse", **numbers, control_image=edges, strength=0.5),
        ])  # fmt: skip
    asked = GenerateRequest("a lighthouse", steps=2, seed=4, height=128, width=128, image=Image.fromarray(edges))
    np.testing.assert_array_equal(
        control.image()[0], np.asarray(generate(load_pipeline(model, engine), asked).images[0])
    )
    asked = GenerateRequest("a lighthouse", steps=2, seed=4, height=128, width=128, image=Image.fromarray(photo),
                            control_image=Image.fromarray(edges))  # fmt: skip
    img2img = load_pipeline(model, engine, task="img2img")
    np.testing.assert_array_equal(both.image()[0], np.asarray(generate(img2img, asked).images[0]))
    np.testing.assert_array_equal(alone.image(), control.image())  # the control map under either name
    assert strong.error.message() == (
        "a request with control_image+strength fits none of this model's tasks: txt2img image, img2img "
        "control_image+image (optional strength), inpaint control_image+image+mask_image (optional strength)"
    )
