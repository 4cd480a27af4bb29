"""An image on the Triton wire: the model ``sdtrt deploy triton`` writes picks each row's task from the images it
carries (img2img, inpainting) and gives the image ``sdtrt generate`` gives; a bad row gets its one-line error and the
others their images. The model's ``execute`` runs here on real numpy rows over the tiny engine set and its diffusers
pipelines (tests/triton_backend.py stands in for the Python backend's module); tests/test_serve.py serves for real."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from sdtrt.pipeline.request import GenerateRequest

from . import triton_backend
from .triton_backend import row

SIZE = 128


def picture(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def box_mask(height: int, width: int) -> np.ndarray:
    pixels = np.zeros((height, width), dtype=np.uint8)
    pixels[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255  # white is repainted
    return pixels


@pytest.fixture(scope="module")
def served(tiny_set, tmp_path_factory):
    with triton_backend.served(tiny_set, tmp_path_factory.mktemp("repo")) as model:
        yield model


def test_config_declares_the_image_inputs_the_served_pipelines_take(served):
    from sdtrt.serving.deploy import wire_inputs

    record, config = served.deployment.record, (served.deployment.folder / "config.pbtxt").read_text()
    assert record["tasks"] == {"txt2img": "StableDiffusionPipeline", "img2img": "StableDiffusionImg2ImgPipeline",
                               "inpaint": "StableDiffusionInpaintPipeline"}  # fmt: skip
    for line in ('{ name: "image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ], optional: true }',
                 '{ name: "mask_image", data_type: TYPE_UINT8, dims: [ -1, -1, 1 ], optional: true }',
                 '{ name: "strength", data_type: TYPE_FP32, dims: [ 1 ], optional: true }'):  # fmt: skip
        assert line in config
    assert "control_image" not in config, "no SD pipeline takes one"
    # The FLUX.1 sets: Fill an image and mask, Canny / Depth a control image (and, img2img / inpaint, an image), Kontext
    # an optional reference, FLUX.2 [klein] its references; a text-to-image set none.
    assert wire_inputs(["FluxFillPipeline"]) == ["image", "mask_image", "strength"]
    assert wire_inputs(["FluxControlPipeline"]) == ["control_image"]
    assert wire_inputs(["FluxKontextPipeline"]) == wire_inputs(["Flux2KleinPipeline"]) == ["image"]


def test_the_tasks_pipelines_share_every_component_and_keep_an_fp16_load(tiny, tiny_engine):
    """A GPU instance loads in fp16; the other tasks' pipelines (from_pipe) must neither copy a component nor cast the
    shared ones back to fp32. A lone UNet engine: the text encoder and VAE are PyTorch weights, fp16 here on a CPU."""
    import torch

    from sdtrt.core.families import served_tasks
    from sdtrt.pipeline.loading import load_pipeline, task_pipelines

    tasks = served_tasks(tiny.pipeline_class())
    pipe = load_pipeline(tiny, tiny_engine, task="txt2img", dtype=torch.float16)
    pipes = task_pipelines(pipe, tasks)
    assert pipes["txt2img"] is pipe and {task: type(p).__name__ for task, p in pipes.items()} == tasks
    networks = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert {"unet", "vae", "text_encoder"} <= set(networks)
    for task, each in pipes.items():
        for name, network in networks.items():
            assert each.components[name] is network, (task, name)
            assert network.dtype == torch.float16, (task, name)


def test_image_rows_pick_their_task_give_generates_image_and_a_bad_row_fails_alone(served, tiny, tiny_set):
    from sdtrt.pipeline.loading import generate, load_pipeline

    image, mask = picture(SIZE, SIZE), box_mask(SIZE, SIZE)
    asked = {
        "img2img": GenerateRequest(prompt="a fox", steps=10, seed=3, strength=0.9, image=Image.fromarray(image)),
        "inpaint": GenerateRequest(prompt="a cat", steps=2, seed=4, height=SIZE, width=SIZE,
                                   image=Image.fromarray(image), mask_image=Image.fromarray(mask, "L")),
    }  # fmt: skip
    requests = [
        row("a fox", steps=10, seed=3, strength=0.9, image=image),  # float32's 0.9 is 0.899999976: 8 steps, not 9
        row("no image", steps=2, mask_image=mask[..., None]),  # a mask alone: no task takes it
        row("a cat", steps=2, seed=4, height=SIZE, width=SIZE, image=image, mask_image=mask[..., None]),
        row("too big", steps=2, image=picture(512, 512)),  # SD img2img makes the input's size: outside the profile
        row("off grid", steps=2, image=picture(100, SIZE)),
        row("sized", steps=2, height=2 * SIZE, width=2 * SIZE, image=image),  # a size asked that is not the image's
        row("too strong", steps=2, strength=1.5, image=image),
        row("text", steps=2, seed=5, height=SIZE, width=SIZE),
        triton_backend.InferenceRequest(  # two img2img rows in one request: each image its own, in order
            prompt=np.array([[b"a hen"], [b"a cow"]], dtype=object),
            steps=np.array([[2], [2]], dtype=np.int32),
            seed=np.array([[6], [7]], dtype=np.uint64),
            strength=np.array([[0.6], [0.6]], dtype=np.float32),
            image=np.stack([picture(SIZE, SIZE, 1), picture(SIZE, SIZE, 2)]),
        ),
    ]
    responses = served.execute(requests)
    errors = {i: r.error for i, r in enumerate(responses) if r.error is not None}
    assert set(errors) == {1, 3, 4, 5, 6}
    assert all(e.code() == "INVALID_ARG" and "\n" not in e.message() for e in errors.values())
    assert errors[1].message() == (
        "a request with mask_image fits none of this model's tasks: txt2img no image, img2img image (optional "
        "strength), inpaint image+mask_image (optional strength)"
    )
    assert (
        errors[3]
        .message()
        .startswith(
            "the input image, whose size the output takes, is 512×512 px (w×h): height 512 is outside the engine's "
            "profile (128..384 px)"
        )
    )
    assert "is 128×100 px (w×h): height 100 is not a positive multiple of 16 pixels" in errors[4].message()
    assert (
        errors[5]
        .message()
        .startswith("the input image is 128×128 px (w×h), not the height 256 and width 256 asked: diffusers'")
    )
    assert errors[6].message().startswith("strength 1.5 is outside 0..1")
    local = {task: load_pipeline(tiny, tiny_set, task=task) for task in asked}
    for index, task in ((0, "img2img"), (2, "inpaint")):
        expected = np.asarray(generate(local[task], asked[task]).images[0])
        np.testing.assert_array_equal(responses[index].image(), expected[None], err_msg=task)
    two = [GenerateRequest(prompt=p, steps=2, seed=seed, strength=0.6, image=Image.fromarray(picture(SIZE, SIZE, n)))
           for n, (p, seed) in enumerate((("a hen", 6), ("a cow", 7)), start=1)]  # fmt: skip
    expected = np.stack([np.asarray(generate(local["img2img"], each).images[0]) for each in two])
    np.testing.assert_array_equal(responses[8].image(), expected)
    text = GenerateRequest(prompt="text", steps=2, seed=5, height=SIZE, width=SIZE)
    np.testing.assert_array_equal(
        responses[7].image()[0], np.asarray(generate(served.pipes["txt2img"], text).images[0])
    )
