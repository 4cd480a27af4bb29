"""FLUX.1 Fill, Canny / Depth control and Kontext on engine sets (issue 38): each pipeline's images as the PyTorch fp32
pipeline's at two sizes (one non-square), every network an engine, and the inputs each task needs refused with one
line before anything runs.

One fp32 ONNX Runtime engine set per preset (its default profile covers both sizes), shared by the module's tests;
requests leave guidance and strength out, so each pipeline runs with its own defaults.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ShapeProfile
from sdtrt.core.errors import RequestError
from sdtrt.pipeline.image_inputs import check_pipeline_inputs
from sdtrt.pipeline.loading import generate
from sdtrt.pipeline.request import GenerateRequest, SizeRule
from sdtrt.standins.transformer import EngineTransformer
from tests.helpers import Family, assert_every_network_is_an_engine, assert_images_match, centre_mask

SIZES = [(128, 128), (128, 192)]
# Each preset's pipeline (the task that picks it) and the images it is given at a size.
TASKS = {"tiny-flux-fill": "inpaint", "tiny-flux-control": "txt2img", "tiny-flux-kontext": "img2img"}


def picture(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def inputs(name: str, height: int, width: int) -> dict:
    """What the preset's pipeline needs at this size: Fill an image and mask, control a control image at the output's
    size, Kontext a reference of another size (resized to FLUX.1 Kontext's preferred resolution nearest its aspect
    ratio, scaled to the tiny model's 256 px: 96x160 → 192x320, 240 tokens)."""
    if name == "tiny-flux-fill":
        return {"image": picture(height, width), "mask_image": centre_mask(height, width)}
    if name == "tiny-flux-control":
        return {"control_image": picture(height, width, seed=1)}
    return {"image": picture(96, 160, seed=2)}


@pytest.fixture(scope="module", params=list(TASKS))
def family(request, store):
    return Family(request.param, store, {})


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_task_matches_pytorch(family, size):
    request = family.request(height=size[0], width=size[1], **inputs(family.name, *size))
    assert_images_match(family, request, TASKS[family.name])


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_control_img2img_and_inpaint_match_pytorch(family, size):
    """FluxControlImg2ImgPipeline and FluxControlInpaintPipeline (--task img2img / inpaint) on the control set."""
    if family.name != "tiny-flux-control":
        pytest.skip("the control set's img2img and inpaint pipelines")
    given = inputs(family.name, *size) | {"image": picture(*size), "strength": 0.8, "steps": 3}
    assert_images_match(family, family.request(height=size[0], width=size[1], **given), "img2img")
    given["mask_image"] = centre_mask(*size)
    assert_images_match(family, family.request(height=size[0], width=size[1], **given), "inpaint")
    for task in ("img2img", "inpaint"):
        assert_every_network_is_an_engine(family.pipelines(task)[1], reads_images=True)


def test_every_network_is_an_engine_and_the_transformer_takes_the_task_inputs(family):
    _, engine = family.pipelines(TASKS[family.name])
    assert_every_network_is_an_engine(engine, reads_images=True)  # Canny / Depth encode their control image
    assert type(engine).__name__ == family.source.pipeline_class()
    spec = engine.transformer.spec
    assert isinstance(engine.transformer, EngineTransformer)
    channels = {"tiny-flux-fill": 384, "tiny-flux-control": 128, "tiny-flux-kontext": 64}[family.name]
    assert (spec.in_channels, spec.out_channels) == (channels, 64)
    patches = (128 // 16) * (192 // 16)
    assert spec.input_shapes(1, 128, 192)["hidden_states"][1] == patches * (2 if spec.reference_tokens else 1)
    patches += (192 // 16) * (320 // 16) if spec.reference_tokens else 0  # the resized reference's
    fed = []  # what the pipeline hands the engine: Kontext's reference tokens follow the generated ones
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        generate(engine, family.request(height=128, width=192, steps=1, **inputs(family.name, 128, 192)))
    finally:
        hook.remove()
    assert fed == [(1, patches, channels)]


def test_missing_or_misfit_inputs_fail_with_one_line_before_running(family):
    _, engine = family.pipelines(TASKS[family.name])
    calls = []
    given = inputs(family.name, 128, 128)
    bad = [{name: value for name, value in given.items() if name != missing} for missing in given]
    if family.name == "tiny-flux-control":
        bad.append({"control_image": picture(128, 192)})  # another aspect ratio: the pipeline would stretch it
    if family.name != "tiny-flux-fill":
        bad.append(given | {"mask_image": centre_mask(128, 128)})
    if family.name == "tiny-flux-kontext":  # without a reference it generates from text: not refused
        latents = torch.zeros(1, 16, 64, 64)  # 1024 reference tokens + 64: more than the profile's 832
        bad = [given | {"mask_image": centre_mask(128, 128)}, {"image": [given["image"]] * 2}, {"image": latents}]
    hook = engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        for kwargs in bad:
            with pytest.raises(RequestError) as error:
                generate(engine, family.request(height=128, width=128, **kwargs))
            assert "\n" not in str(error.value)
    finally:
        hook.remove()
    assert not calls
    if family.name == "tiny-flux-kontext":
        assert "1088 is outside the engines' 64..832" in str(error.value)


def test_guidance_and_strength_default_to_the_pipelines_own(family):
    """diffusers' __call__ defaults per class: Fill guidance 30 and strength 1 (every step), control img2img guidance 7
    and strength 0.6 (3 of 4 steps), FluxPipeline-like 3.5. The transformer is handed the guidance each step."""
    tasks = {"tiny-flux-fill": [("inpaint", 30.0, 4)], "tiny-flux-kontext": [("img2img", 3.5, 4)],
             "tiny-flux-control": [("txt2img", 3.5, 4), ("img2img", 7.0, 3)]}[family.name]  # fmt: skip
    fed: list[float] = []
    for task, guidance, steps in tasks:
        _, engine = family.pipelines(task)
        given = inputs(family.name, 128, 128) | ({"image": picture(128, 128)} if task == "img2img" else {})
        fed.clear()
        hook = engine.transformer.register_forward_pre_hook(
            lambda _, args, kwargs: fed.append(float(kwargs["guidance"][0])), with_kwargs=True
        )
        try:
            generate(engine, family.request(height=128, width=128, steps=4, **given))
        finally:
            hook.remove()
        assert fed == [guidance] * steps, (task, fed)


def test_inputs_are_checked_before_sizes_and_a_proportional_control_image_is_taken(family):
    """The CLI's order: what the pipeline takes, then the control image's aspect ratio; diffusers resizes a control
    image of the output's aspect ratio, so one of half the size runs."""
    rule = SizeRule.for_model(family.source)
    misfit = GenerateRequest(
        **inputs(family.name, 128, 128) | {"control_image": picture(64, 96)}, height=128, width=128
    )
    takes_control = family.name == "tiny-flux-control"
    with pytest.raises(RequestError, match="another aspect ratio" if takes_control else "takes no control image"):
        check_pipeline_inputs(misfit, family.source.pipeline_class(), TASKS[family.name], rule)
    if takes_control:
        _, engine = family.pipelines("txt2img")
        result = generate(engine, family.request(height=128, width=128, steps=1, control_image=picture(64, 64)))
        assert result.images[0].size == (128, 128)


def test_kontext_generates_from_text_and_its_profile_covers_a_default_diffusers_call(family):
    """Without a reference FluxKontextPipeline generates from text (the profile's minimum has no reference tokens);
    at FLUX.1's 1024 px the default profile takes a 1024x1024 image with a 672x1568 reference (4096 + 4116 tokens),
    and the VAE encoder's 1568x672 and 672x1568 references."""
    import dataclasses

    from sdtrt.spec.transformer import reference_sizes

    if family.name != "tiny-flux-kontext":
        pytest.skip("FLUX.1 Kontext's reference")
    assert_images_match(family, family.request(height=128, width=128), "img2img")
    _, engine = family.pipelines("img2img")
    flux1 = dataclasses.replace(engine.transformer.spec, latent_sample_size=128)  # FLUX.1's 1024 px
    low, _, high = (s[1] for s in flux1.profile_shapes(flux1.default_profile())["hidden_states"])
    assert low <= 32 * 32 and high >= 4096 + 42 * 98
    assert {(672, 1568), (1568, 672)} <= set(reference_sizes(1024, 16))
    encoder = engine.vae.encoder_runtime.spec
    assert (encoder.reference_min_px, encoder.reference_max_px) == (160, 384)  # 672 and 1568 scaled to 256 px
    wide = dataclasses.replace(encoder, native_px=1024, reference_min_px=672, reference_max_px=1568)
    for size in ((1568, 672), (672, 1568)):
        assert wide.check_shapes({"sample": (1, 3, *size)}, ShapeProfile.around(1024, 8)) is None, size


def test_triton_serves_the_task_with_its_images_and_refuses_a_row_without_them(family, tmp_path):
    """Deployed, the set's Triton model (its execute on numpy rows, tests/triton_backend.py) gives a row with the task's
    images the engine pipeline's image, and a row lacking one its one-line error; the config declares what it takes."""
    from tests import triton_backend

    size = (128, 192)
    given = inputs(family.name, *size)
    _, engine = family.pipelines(TASKS[family.name])
    local = np.asarray(generate(engine, family.request(height=size[0], width=size[1], **given)).images[0])
    lacking = {  # Fill: no mask; control: a control image of another aspect ratio; Kontext: a mask, which it takes not
        "tiny-flux-fill": lambda: {"image": given["image"]},
        "tiny-flux-control": lambda: {"control_image": picture(128, 128)},
        "tiny-flux-kontext": lambda: {"mask_image": centre_mask(*size)},
    }[family.name]()
    with triton_backend.served(family.engine, tmp_path) as model:
        request = family.request(height=size[0], width=size[1])
        numbers = {"steps": request.steps, "seed": request.seed, "height": size[0], "width": size[1]}
        good, bad = model.execute([triton_backend.row(request.prompt, **numbers, **given),
                                   triton_backend.row("bad", **numbers, **lacking)])  # fmt: skip
        config = (model.deployment.folder / "config.pbtxt").read_text()
    np.testing.assert_array_equal(good.image()[0], local)
    assert bad.error.code() == "INVALID_ARG" and "\n" not in bad.error.message()
    assert {"tiny-flux-fill": "fits none of this model's tasks: inpaint image+mask_image (optional strength)",
            "tiny-flux-control": "the control image is 128×128 px (w×h) and the image to generate 192×128 px (w×h)",
            "tiny-flux-kontext": "fits none of this model's tasks: img2img no image (optional image)",
            }[family.name] in bad.error.message()  # fmt: skip
    names = ("image", "mask_image", "control_image", "image_reference", "strength")
    declared = {name for name in names if f'"{name}"' in config}
    assert (
        declared
        == {
            "tiny-flux-fill": {"image", "mask_image", "strength"},
            "tiny-flux-kontext": {"image", "mask_image", "image_reference", "strength"},  # its inpainting one's too
            "tiny-flux-control": {"image", "mask_image", "control_image", "strength"},
        }[family.name]
    )


@pytest.mark.parametrize(
    "size", [pytest.param((128, 128), marks=pytest.mark.slow, id="square"), pytest.param((128, 192), id="non-square")]
)
def test_kontext_inpaint_matches_pytorch_its_image_the_reference_tokens(family, size):
    """FluxKontextInpaintPipeline (--task inpaint) on the Kontext set: the image to repaint, resized to the output's
    size, is encoded by the set's VAE encoder engine and its latents follow the generated ones (twice the output's
    tokens, inside the default profile)."""
    if family.name != "tiny-flux-kontext":
        pytest.skip("FLUX.1 Kontext's inpainting")
    _, engine = family.pipelines("inpaint")
    assert type(engine).__name__ == "FluxKontextInpaintPipeline"
    assert_every_network_is_an_engine(engine, reads_images=True)
    given = {"image": picture(96, 160, seed=2), "mask_image": centre_mask(96, 160), "strength": 0.8}
    fed = []
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        assert_images_match(family, family.request(height=size[0], width=size[1], **given), "inpaint")
    finally:
        hook.remove()
    assert set(fed) == {(1, 2 * (size[0] // 16) * (size[1] // 16), 64)}


def test_kontext_inpaint_with_a_reference_image_matches_pytorch(family):
    """FluxKontextInpaintPipeline's image_reference: a reference apart from the image to repaint, resized as a Kontext
    reference is (a 96-wide, 160-high portrait → Kontext's 784x1312 scaled to 256 px: 192 wide, 320 high, 240 tokens),
    whose tokens, not the repainted image's, follow the generated ones; the image is PyTorch fp32's."""
    if family.name != "tiny-flux-kontext":
        pytest.skip("FLUX.1 Kontext's inpainting")
    _, engine = family.pipelines("inpaint")
    given = {"image": picture(96, 160, seed=2), "mask_image": centre_mask(96, 160), "strength": 0.8}
    fed = []
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape), with_kwargs=True
    )
    try:
        request = family.request(height=128, width=192, image_reference=picture(160, 96, seed=4), **given)
        assert_images_match(family, request, "inpaint")
    finally:
        hook.remove()
    assert set(fed) == {(1, (128 // 16) * (192 // 16) + 240, 64)}


def test_kontext_inpaint_without_its_image_or_mask_is_refused_before_running(family):
    """By generate before an engine runs, and by the check `sdtrt generate --task inpaint` makes before loading."""
    if family.name != "tiny-flux-kontext":
        pytest.skip("FLUX.1 Kontext's inpainting")
    _, engine = family.pipelines("inpaint")
    rule = SizeRule.for_model(family.source)
    calls: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in (engine.transformer, engine.vae)]
    try:
        lacks = ({"mask_image": centre_mask(128, 128)}, "--image"), ({"image": picture(128, 128)}, "--mask")
        for lacking, flag in lacks:
            request = family.request(height=128, width=128, image_reference=picture(128, 128), **lacking)
            with pytest.raises(RequestError, match=rf"^--task inpaint needs an? [a-z ]+: pass {flag}$"):
                generate(engine, request)
            with pytest.raises(RequestError, match=rf"pass {flag}$"):
                check_pipeline_inputs(request, family.source.pipeline_class(), "inpaint", rule)
        # A reference to inpaint by, given to Kontext's img2img pipeline: --task inpaint takes it.
        request = family.request(height=128, width=128, image=picture(128, 128), image_reference=picture(128, 128))
        with pytest.raises(RequestError, match=r"takes no image reference \(--reference-image is FLUX.1 Kontext and"):
            check_pipeline_inputs(request, family.source.pipeline_class(), None, rule)
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls


@pytest.mark.slow  # 13 s a preset
def test_validate_runs_the_task_pipeline_with_its_images(family):
    """validate compares every member, then the images of the set's own pipeline, given the images it needs."""
    from sdtrt.tools.validate import ValidationConfig, validate

    report = validate(family.source, family.engine, ValidationConfig(steps=2, height=128, width=192))
    assert report, report.failures
    assert report.image["case"]["pipeline"] == family.source.pipeline_class() and report.image["psnr_db"] >= 35.0


@pytest.mark.parametrize("size", [(512, 554), (554, 512), (1000, 1000), (300, 900)])
def test_a_kontext_reference_is_resized_to_the_resolution_diffusers_picks(size):
    """Diffusers reads the aspect ratio after rounding the sides down to 16 px (get_default_height_width), then
    picks the nearest preferred resolution: 512 wide x 554 high is 1024x1024 there, 944x1104 on the raw ratio."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    from sdtrt.pipeline.image_inputs import kontext_reference

    image = Image.new("RGB", size)
    height, width = VaeImageProcessor(vae_scale_factor=16).get_default_height_width(image)
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    resized, tokens, out = kontext_reference(image, SizeRule(16, 1024, 1024), pipe=None)
    assert resized == (h, w) and out.size == (w, h) and tokens == (h // 16) * (w // 16)
