"""FLUX.1 ControlNet (FluxControlNetPipeline, issue 38) on an engine set: the ControlNet an engine of its own whose
block samples the transformer engine adds, the images as the PyTorch fp32 pipeline's, and what the graphs cannot run
refused in one line before anything runs.

tiny-flux-controlnet is tiny-flux with a FluxControlNetModel built last: its text encoders and VAE are tiny-flux's, so
a session that compiled tiny-flux exports only the transformer (with the samples' inputs) and the ControlNet.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxControlNetModel, FluxMultiControlNetModel
from PIL import Image

from sdtrt.core.errors import EngineInputError, RequestError, UnsupportedModelError
from sdtrt.pipeline.loading import generate, with_components
from sdtrt.spec import FluxControlNetSpec, component_spec
from sdtrt.spec.controlnet_samples import controlnet_samples
from sdtrt.standins.controlnet_flux import EngineFluxControlNet
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import Family, assert_every_network_is_an_engine, assert_images_match
from tests.test_cli_friction import usage_error_before_loading

PRESET = "tiny-flux-controlnet"


def picture(height: int, width: int, seed: int = 1) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def family(store):
    return Family(PRESET, store, {})


@pytest.fixture(scope="module")
def source():
    """The preset alone, for the tests that read its configs: no compile."""
    from sdtrt.sources.models import resolve_model

    return resolve_model(PRESET)


@pytest.mark.slow  # compiling the set: ~50 CPU s, over the default suite's budget
def test_controlnet_set_matches_pytorch_and_its_control_image_counts(family):
    """128x192 (non-square) against the PyTorch fp32 pipeline, each step's samples going from the ControlNet engine
    into the transformer engine; another control image gives another image (the samples are not dropped)."""
    request = family.request(height=128, width=192, control_image=picture(128, 192))
    _, engine = family.pipelines()
    networks = assert_every_network_is_an_engine(engine, reads_images=True)  # the control image is VAE-encoded
    assert set(networks) == {"text_encoder", "text_encoder_2", "transformer", "vae", "controlnet"}
    assert isinstance(engine.controlnet, EngineFluxControlNet) and isinstance(engine.controlnet, FluxControlNetModel)
    assert engine.controlnet.input_hint_block is None  # InstantX's kind: the control image VAE-encoded and packed
    fed = []
    hook = engine.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append([s.shape for s in kwargs["controlnet_block_samples"]]), with_kwargs=True
    )
    try:
        assert_images_match(family, request)
    finally:
        hook.remove()
    assert fed == [[(1, (128 // 16) * (192 // 16), 32)]] * request.steps
    other = generate(engine, family.request(height=128, width=192, control_image=picture(128, 192, seed=2)))
    first = generate(engine, request)
    assert np.abs(np.asarray(other.images[0], float) - np.asarray(first.images[0], float)).mean() > 1.0


@pytest.mark.slow
def test_controlnet_set_matches_pytorch_square_img2img_inpaint_and_two_controlnets(family):
    """256x256 (the model's native size), FluxControlNetImg2ImgPipeline / FluxControlNetInpaintPipeline (--task
    img2img / inpaint) at 128x192 and 128x128, every network an engine, and FluxMultiControlNetModel summing the
    ControlNet twice at scales 1.0 and 0.5."""
    assert_images_match(family, family.request(height=256, width=256, control_image=picture(256, 256)))
    pipelines = [with_components(p, {"controlnet": FluxMultiControlNetModel([p.controlnet] * 2)})
                 for p in family.pipelines()]  # fmt: skip
    given = dict(control_image=[picture(256, 256), picture(256, 256, seed=4)], controlnet_conditioning_scale=[1.0, 0.5])
    images = [
        pipe("a lighthouse", num_inference_steps=2, height=256, width=256, output_type="np",
             generator=torch.Generator().manual_seed(5), **given).images[0]
        for pipe in pipelines
    ]  # fmt: skip
    psnr = psnr_db(images[1], images[0])
    print(f"{PRESET} two ControlNets 256x256: PSNR {psnr:.1f} dB")
    assert psnr >= 35.0
    for height, width in [(128, 192), (128, 128)]:
        mask = np.zeros((height, width), dtype=np.uint8)
        mask[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
        given = {"control_image": picture(height, width), "image": picture(height, width, seed=3), "strength": 0.8}
        assert_images_match(family, family.request(height=height, width=width, steps=3, **given), "img2img")
        given["mask_image"] = Image.fromarray(mask)
        assert_images_match(family, family.request(height=height, width=width, steps=3, **given), "inpaint")
    for task in ("img2img", "inpaint"):
        assert_every_network_is_an_engine(family.pipelines(task)[1], reads_images=True)


@pytest.mark.slow  # on the compiled set (~30 s of setup in CI)
def test_samples_the_engines_cannot_take_are_refused(family):
    """The transformer engine adds the ControlNet's one double and one single sample: other counts, or XLabs' repeated
    samples, are refused."""
    _, engine = family.pipelines()
    transformer, spec = engine.transformer, engine.transformer.spec
    assert spec.controlnet_samples == (1, 1)
    inputs = spec.sample_inputs(1, 128, 128, tokens=32)
    plain = {k: v for k, v in inputs.items() if not k.startswith("controlnet_")}
    sample = inputs["controlnet_block_sample_0"]
    without = transformer(**plain).sample  # no samples passed: zeros added, as adding none
    assert torch.allclose(without, transformer(**plain, controlnet_block_samples=[sample * 0]).sample)
    assert not torch.allclose(without, transformer(**plain, controlnet_block_samples=[sample]).sample)
    for kwargs in (
        {"controlnet_block_samples": [sample, sample]},
        {"controlnet_block_samples": [sample], "controlnet_blocks_repeat": True},
    ):
        with pytest.raises(EngineInputError) as error:
            transformer(**plain, **kwargs)
        assert "\n" not in str(error.value)


def test_xlabs_and_union_controlnets_are_refused_in_one_line():
    config = {"num_layers": 2, "num_single_layers": 0}
    assert controlnet_samples(config) == (2, 0)
    for kind in ({"conditioning_embedding_channels": 16}, {"num_mode": 10}, {"num_layers": 0}):
        with pytest.raises(UnsupportedModelError) as error:
            controlnet_samples(config | kind)
        assert "\n" not in str(error.value)


def test_a_plain_flux_transformer_keeps_its_graph_contract(source):
    """Only a ControlNet set's transformer takes samples: tiny-flux's (the same folder) keeps its JSON and so its
    keys (tests/test_transformer_pipelines.py: its engine refuses samples)."""
    from sdtrt.sources.models import resolve_model

    plain = component_spec(resolve_model("tiny-flux"), "transformer", "fp32").to_json()
    controlnet_set = component_spec(source, "transformer", "fp32").to_json()
    without_io = [{k: v for k, v in spec.items() if k != "inputs"} for spec in (plain, controlnet_set)]
    assert without_io[1] == without_io[0] | {"controlnet_samples": (1, 1), "controlnet_width": 32}
    assert isinstance(component_spec(source, "controlnet", "fp32"), FluxControlNetSpec)


def test_a_controlnet_sets_transformer_is_traced_whole_at_any_depth(source):
    """Its samples are added between the blocks, which stamped copies would skip (graph/onnx_stamp.py refuses such
    a trace): at FLUX.1's depth a ControlNet set's transformer stamps nothing, a plain one its two lists."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.stages.export_stream import stamped_blocks, stamped_reason

    depth = {"num_layers": 19, "num_single_layers": 38}
    controlnet_set = component_spec(source, "transformer", "fp32")
    assert stamped_blocks(controlnet_set, source.component_config("transformer") | depth) == {}
    assert stamped_reason(controlnet_set, "stream", {}) == (
        "traced whole: a FLUX.1 ControlNet set's samples are added between its blocks, which stamped copies would skip"
    )
    plain = component_spec(resolve_model("tiny-flux"), "transformer", "fp32")
    assert len(stamped_blocks(plain, resolve_model("tiny-flux").component_config("transformer") | depth)) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "this model's txt2img pipeline needs a control image: pass --control-image"),
        (
            ["--control-image", "{wide}"],
            "the control image is 128×64 px (w×h) and the image to generate 256×256 px (w×h)",
        ),
    ],
)
def test_generate_refuses_a_missing_or_misfit_control_image_before_loading(args, message, tmp_path):
    """sdtrt generate reads the pipeline's inputs from model_index.json: a control image of another aspect ratio than
    the output (the pipeline would stretch it) is refused in one line before diffusers is imported."""
    from sdtrt.sources.models import resolve_model

    resolve_model(PRESET)
    picture(64, 128).save(tmp_path / "wide.png")
    args = [a.format(wide=tmp_path / "wide.png") for a in args]
    assert message in usage_error_before_loading("generate", "--model", PRESET, *args)


@pytest.mark.slow  # on the compiled set (the refusal before loading is the default suite's, above)
def test_a_control_image_of_another_aspect_ratio_is_refused_before_any_engine_runs(family):
    _, engine = family.pipelines()
    calls = []
    hook = engine.controlnet.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(RequestError) as error:
            generate(engine, family.request(height=128, width=128, control_image=picture(128, 192)))
    finally:
        hook.remove()
    assert "another aspect ratio" in str(error.value) and "\n" not in str(error.value) and not calls
