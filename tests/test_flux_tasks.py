"""FLUX.1 Fill, Canny / Depth control and Kontext on engine sets (issue 38): each pipeline's images as the PyTorch fp32
pipeline's at two sizes (one non-square), every network an engine, and the inputs each task needs refused with one
line before anything runs.

One fp32 ONNX Runtime engine set per preset (its default profile covers both sizes), shared by the module's tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.errors import RequestError
from sdtrt.pipeline.loading import generate
from sdtrt.standins.base import EngineModule
from sdtrt.standins.transformer import EngineTransformer
from tests.helpers import Family, assert_images_match

SIZES = [(128, 128), (128, 192)]
# Each preset's pipeline (the task that picks it) and the images it is given at a size.
TASKS = {"tiny-flux-fill": "inpaint", "tiny-flux-control": "txt2img", "tiny-flux-kontext": "img2img"}


def picture(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def mask(height: int, width: int) -> Image.Image:
    pixels = np.zeros((height, width), dtype=np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255  # white is repainted
    return Image.fromarray(pixels)


def inputs(name: str, height: int, width: int) -> dict:
    """What the preset's pipeline needs at this size: Fill an image and mask, control a control image at the output's
    size, Kontext a reference of another size (generate resizes it to the output's)."""
    if name == "tiny-flux-fill":
        return {"image": picture(height, width), "mask_image": mask(height, width)}
    if name == "tiny-flux-control":
        return {"control_image": picture(height, width, seed=1)}
    return {"image": picture(96, 160, seed=2)}


@pytest.fixture(scope="module", params=list(TASKS))
def family(request, store):
    return Family(request.param, store, {"guidance": 3.5})


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
    given["mask_image"] = mask(*size)
    assert_images_match(family, family.request(height=size[0], width=size[1], **given), "inpaint")


def test_every_network_is_an_engine_and_the_transformer_takes_the_task_inputs(family):
    _, engine = family.pipelines(TASKS[family.name])
    networks = {name: m for name, m in engine.components.items() if isinstance(m, torch.nn.Module)}
    assert networks and all(isinstance(m, EngineModule) for m in networks.values()), networks
    assert type(engine).__name__ == family.source.pipeline_class()
    spec = engine.transformer.spec
    assert isinstance(engine.transformer, EngineTransformer) and engine.vae.encoder is not None
    channels = {"tiny-flux-fill": 384, "tiny-flux-control": 128, "tiny-flux-kontext": 64}[family.name]
    assert (spec.in_channels, spec.out_channels) == (channels, 64)
    patches = (128 // 16) * (192 // 16) * (2 if family.name == "tiny-flux-kontext" else 1)
    assert spec.input_shapes(1, 128, 192)["hidden_states"] == (1, patches, channels)
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
    engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    given = inputs(family.name, 128, 128)
    bad = [{name: value for name, value in given.items() if name != missing} for missing in given]
    if family.name == "tiny-flux-control":
        bad.append({"control_image": picture(128, 192)})  # the pipeline would stretch it to 128x128
    if family.name != "tiny-flux-fill":
        bad.append(given | {"mask_image": mask(128, 128)})
    for kwargs in bad:
        with pytest.raises(RequestError) as error:
            generate(engine, family.request(height=128, width=128, **kwargs))
        assert "\n" not in str(error.value)
    assert not calls


@pytest.mark.slow  # 13 s a preset
def test_validate_runs_the_task_pipeline_with_its_images(family):
    """validate compares every member, then the images of the set's own pipeline, given the images it needs."""
    from sdtrt.tools.validate import ValidationConfig, validate

    report = validate(family.source, family.engine, ValidationConfig(steps=2, height=128, width=192))
    assert report, report.failures
    assert report.image["case"]["pipeline"] == family.source.pipeline_class() and report.image["psnr_db"] >= 35.0
