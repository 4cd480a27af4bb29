"""Z-Image on an engine set (issue 38): the Qwen3 LLM text encoder (its penultimate layer), the ZImageTransformer2DModel
(its padded-batch graph behind diffusers' list call) and the Flux-style AutoencoderKL each an engine stand-in; images
as the PyTorch fp32 pipeline's for txt2img, img2img and inpaint at two sizes; bad input refused in one line before
anything runs.

fp32 ONNX Runtime engines (TorchScript's exporter: seconds, where torch.export's takes half a minute over the
transformer; the slow test holds the default exporter to the same images), shared by the module's tests; tiny sizes,
two steps, classifier-free guidance (positive and negative captions of different lengths in one transformer call).
The default suite builds the txt2img set (no VAE encoder) and checks one size; -m slow adds the other size and
img2img / inpaint, whose only new parts (the VAE encoder, the pipelines' own code) other families' tests cover.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.standins.llm_encoder import EngineQwen3Model
from sdtrt.standins.transformer import EngineZImageTransformer
from sdtrt.standins.vae import EngineVAE
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import assert_every_network_is_an_engine

FP32 = ExportConfig(precision="fp32", exporter="torchscript")
SQUARE, NON_SQUARE = (128, 128), (128, 192)
SIZES = [pytest.param(SQUARE, marks=pytest.mark.slow, id="square"), pytest.param(NON_SQUARE, id="non-square")]


@pytest.fixture(scope="module")
def zimage(store):
    """The preset, its txt2img engine set, and the (PyTorch fp32, engine) txt2img pipelines."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-zimage")
    components = ("text_encoder", "transformer", "vae_decoder")
    engine = compile_model(source, store, "onnxruntime", FP32, components=components).final
    return source, engine, (load_pipeline(source), load_pipeline(source, engine))


@pytest.fixture(scope="module")
def zimage_edits(zimage, store):
    """Per edit task, the (PyTorch fp32, engine) pipelines on the whole set (the VAE encoder too)."""
    from sdtrt.tools.compile import compile_model

    source = zimage[0]
    engine = compile_model(source, store, "onnxruntime", FP32).final
    return {task: (load_pipeline(source, task=task), load_pipeline(source, engine, task=task)) for task in EDITS}


EDITS = ("img2img", "inpaint")


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def request(task: str, size: tuple[int, int], **kwargs) -> GenerateRequest:
    inputs: dict = {"image": noise_image(*size)} if task != "txt2img" else {}
    if task == "inpaint":
        mask = np.zeros(size, dtype=np.uint8)
        mask[size[0] // 4 : 3 * size[0] // 4, size[1] // 4 : 3 * size[1] // 4] = 255
        inputs |= {"mask_image": Image.fromarray(mask)}
    base = {"prompt": "a red fox in the snow", "steps": 2, "seed": 3, "height": size[0], "width": size[1]}
    return GenerateRequest(**(base | inputs | kwargs))


def test_every_network_is_an_engine_standin(zimage):
    engine = zimage[2][1]
    assert set(assert_every_network_is_an_engine(engine)) == {"text_encoder", "transformer", "vae"}
    assert isinstance(engine.text_encoder, EngineQwen3Model) and isinstance(engine.transformer, EngineZImageTransformer)
    assert isinstance(engine.vae, EngineVAE)
    assert engine.text_encoder.spec.hidden_layers == (3,)  # the penultimate of 4 layers: hidden_states[-2]


def assert_matches_pytorch(pipes, task: str, size: tuple[int, int]) -> None:
    reference, engine = (generate(p, request(task, size), output_type="np").images[0] for p in pipes)
    psnr = psnr_db(engine, reference)
    print(f"tiny-zimage {task} {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    assert reference.shape == (*size, 3) and reference.std() > 0.01 and psnr >= 35.0


@pytest.mark.parametrize("size", SIZES)
def test_txt2img_matches_pytorch(zimage, size):
    assert_matches_pytorch(zimage[2], "txt2img", size)


@pytest.mark.slow
@pytest.mark.parametrize("size", [SQUARE, NON_SQUARE], ids=["square", "non-square"])
@pytest.mark.parametrize("task", EDITS)
def test_edits_match_pytorch(zimage_edits, task, size):
    assert_every_network_is_an_engine(zimage_edits[task][1], reads_images=True)
    assert_matches_pytorch(zimage_edits[task], task, size)


def test_the_transformer_standin_keeps_diffusers_call(zimage):
    """Lists in, a list out, as the PyTorch transformer: captions of different lengths (the padded graph's masks) and
    an image whose patches are not a multiple of 32 (the graph's pad tokens), against diffusers' forward; other
    captions give another output (the engine reads them)."""
    reference, engine = (p.transformer for p in zimage[2])
    pads = reference.x_pad_token, reference.cap_pad_token  # random in the preset: swapped or zero pads would show
    assert pads[0].abs().min() > 0 and not torch.allclose(*pads)
    gen = torch.Generator().manual_seed(0)
    latents = [torch.randn(16, 1, 18, 14, generator=gen) for _ in range(2)]  # 9 × 7 = 63 patches
    captions = [torch.randn(n, 32, generator=gen) for n in (5, 40)]
    t = torch.tensor([0.3, 0.3])
    want, got = (net(latents, t, captions, return_dict=False)[0] for net in (reference, engine))
    assert isinstance(got, list) and len(got) == 2
    assert all(
        g.shape == w.shape == (16, 1, 18, 14) and torch.allclose(g, w, atol=1e-4)
        for g, w in zip(got, want, strict=True)
    )
    other = engine(latents, t, [-c for c in captions], return_dict=False)[0]
    assert all((o - g).abs().max() > 1e-2 for o, g in zip(other, got, strict=True))
    with pytest.raises(EngineInputError, match=r"^[^\n]+$"):
        engine([latents[0], torch.randn(16, 1, 16, 20)], t, captions)  # 96 patches padded beside 64: two lengths


@pytest.mark.parametrize("task", EDITS)
def test_an_edit_without_its_image_is_refused_before_running(zimage, task):
    """By generate before an engine runs (the edit pipeline made from the txt2img one: no VAE encoder needed), and by
    the check `sdtrt generate` makes before loading (no subprocess: the CLI's call of it is tested for every family in
    test_cli.py)."""
    import diffusers

    from sdtrt.core.families import pipeline_class_name
    from sdtrt.pipeline.image_inputs import check_pipeline_inputs
    from sdtrt.pipeline.request import SizeRule

    source, _, (_, txt2img) = zimage
    engine = getattr(diffusers, pipeline_class_name("ZImagePipeline", task)).from_pipe(txt2img)
    calls: list[int] = []
    hooks = [
        m.register_forward_pre_hook(lambda *_: calls.append(1))
        for m in (txt2img.text_encoder, txt2img.transformer, txt2img.vae)
    ]
    req = request("txt2img", SQUARE)  # no image, no mask
    try:
        with pytest.raises(RequestError, match=r"^--task (img2img|inpaint) needs an input image: pass --image$"):
            generate(engine, req)
    finally:
        for hook in hooks:
            hook.remove()
    with pytest.raises(RequestError, match=r"--image"):
        check_pipeline_inputs(req, "ZImagePipeline", task, SizeRule.for_model(source))
    assert not calls


def test_a_prompt_over_the_llm_engines_tokens_is_refused_before_running(zimage):
    engine = zimage[2][1]
    calls = []
    for network in (engine.text_encoder, engine.transformer):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(RequestError, match="tokens with its chat template") as error:
        generate(engine, request("txt2img", SQUARE, prompt="astronaut " * 600))
    assert "\n" not in str(error.value) and not calls


def test_fp16_builds_the_transformer_and_the_llm_in_bf16_where_the_target_runs_it(zimage):
    """Z-Image is a bf16 model whose transformer overflows fp16 (black images) and so does its Qwen3: asked for fp16,
    compile builds both in bf16 where the target has bf16, fp32 where not (ONNX Runtime on a CPU)."""
    from sdtrt.spec import ZImageTransformerSpec
    from sdtrt.stages.export import precision_note
    from sdtrt.tools.compile import component_precision

    source = zimage[0]
    for component in ("transformer", "text_encoder"):
        assert component_precision(source, component, "fp16", "tensorrt-rtx") == "bf16"
        assert component_precision(source, component, "fp16", "onnxruntime") == "fp32"
    assert component_precision(source, "transformer", "fp32", "tensorrt-rtx") == "fp32"
    note = precision_note(ZImageTransformerSpec.for_model(source, precision="bf16"))
    assert note["graph"] == "bf16" and "overflow fp16" in note["why"]


@pytest.mark.slow
def test_default_exporter_through_the_cli(zimage, store, tmp_path):
    """The set as `sdtrt compile` builds it by default (torch.export's exporter for the transformer), run by `sdtrt
    generate`: the PyTorch pipeline's image."""
    from sdtrt.tools.compile import compile_model

    from .helpers import run_cli

    source, out = zimage[0], tmp_path / "fox.png"
    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    args = ("--prompt", "a red fox", "--steps", "2", "--height", "128", "--width", "192", "--seed", "3")
    result = run_cli("generate", "--engine", str(engine.path), *args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    reference = generate(zimage[2][0], request("txt2img", NON_SQUARE, prompt="a red fox"), output_type="np")
    got = np.asarray(Image.open(out).convert("RGB"), dtype=np.float32) / 255
    psnr = psnr_db(got, reference.images[0])
    print(f"tiny-zimage txt2img 128x192, default exporter, sdtrt generate: PSNR {psnr:.1f} dB")
    assert psnr >= 35.0


def test_the_llm_layers_come_from_the_pipeline_class_and_an_unknown_one_is_refused():
    from sdtrt.core.errors import UnsupportedModelError
    from sdtrt.spec.llm_encoder import pipeline_layers

    assert pipeline_layers("ZImageInpaintPipeline", 36) == (35,)  # hidden_states[-2] of 36 layers + the embedding
    assert pipeline_layers("Flux2KleinPipeline", 36) == (9, 18, 27)
    for unknown in ("QwenImagePipeline", ""):
        with pytest.raises(UnsupportedModelError, match=r"^[^\n]+ Flux2KleinPipeline, ZImagePipeline[^\n]+$"):
            pipeline_layers(unknown, 36)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantizing_the_transformer_is_refused(precision):
    """ModelOpt's quantized graph keeps the other layers in fp16 for every family but Flux: the overflow bf16 avoids."""
    from sdtrt.core.config import QuantizeConfig
    from sdtrt.core.errors import ConfigError
    from sdtrt.sources.models import resolve_model
    from sdtrt.stages.quantize import check_model

    with pytest.raises(ConfigError, match=r"^a quantized zimage transformer would keep [^\n]+ overflow fp16[^\n]+$"):
        check_model(QuantizeConfig(precision=precision), resolve_model("tiny-zimage"))


def test_img2img_and_inpaint_take_their_images_size():
    """ZImageImg2ImgPipeline and ZImageInpaintPipeline encode their image at its own size (and fail in diffusers
    given another: its latents another shape than the noise's), so a request without a size takes the image's and one
    asking another is refused in one line before anything loads."""
    from PIL import Image

    from sdtrt.core.errors import RequestError
    from sdtrt.pipeline.image_inputs import sized_by_image
    from sdtrt.pipeline.request import GenerateRequest

    fox = Image.new("RGB", (192, 128))
    for pipeline in ("ZImageImg2ImgPipeline", "ZImageInpaintPipeline"):
        sized = sized_by_image(GenerateRequest(image=fox), pipeline, 16)
        assert (sized.height, sized.width) == (128, 192)
        refusal = rf"^the input image is 192×128 px \(w×h\), not the height 128 and width 128 asked: [^\n]*{pipeline}"
        with pytest.raises(RequestError, match=refusal + " makes its output's size from its input image; leave"):
            sized_by_image(GenerateRequest(image=fox, height=128, width=128), pipeline, 16)
