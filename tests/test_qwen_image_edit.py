"""Qwen-Image-Edit (issue 38) on an engine set: QwenImageEditPipeline with every network an engine stand-in (the
Qwen2.5-VL vision tower on the condition image, the LLM on the prompt with its image's embeddings, the transformer
on the generated tokens followed by the condition image's packed latents, the VAE encoder and decoder), images as
the PyTorch fp32 pipeline's; an edit without its image refused in one line before anything runs.

The preset ``tiny-qwen-image-edit`` is tiny-qwen-image as an Edit folder: its tokenizer with the vision tokens, a
processor (transformers' slow image processor; ImageQwen2VLProcessor, since transformers makes no Qwen2VLProcessor
without torchvision) resizing the ~1024² condition image to at most 112² pixels (16 image tokens). One fp32 ONNX
Runtime set shared by the module's tests (TorchScript's exporter, a profile of the two test sizes); the transformer
reads ~4100 image tokens a call (the condition image's 4096 after the output's), the VAE encoder a ~1024² image.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ExportConfig, Range, ShapeProfile, SimplifyConfig
from sdtrt.core.errors import RequestError
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.standins.llm_encoder import EngineQwen2_5_VL
from sdtrt.standins.qwen_vision import EngineQwen2_5_VisionTower
from sdtrt.standins.transformer import EngineQwenImageTransformer
from sdtrt.standins.vae_qwen import EngineQwenImageVAE
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import assert_every_network_is_an_engine, centre_mask

# One prompt, the test sizes (up to 1184 px: QwenImageEditInpaintPipeline's output is its ~1024² condition image's
# size), and up to 512 tokens the transformer reads: the offline tokenizer spells the Edit template's system prompt in
# ~260 tokens past the 64 the pipeline drops, then the image's 16 and the prompt's.
PROFILE = ShapeProfile(Range(1, 1, 1), Range(128, 128, 1184), Range(128, 128, 1184), False, Range(1, 300, 512))


@pytest.fixture(scope="module")
def edit(store):
    """The preset, and its (PyTorch fp32, engine) pipelines."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-qwen-image-edit")
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine = compile_model(source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE).final
    return source, load_pipeline(source), load_pipeline(source, engine)


def picture(height: int = 96, width: int = 128) -> Image.Image:
    """A smooth gradient with noise (structure the edit keeps), not of the output's size: the pipeline resizes it."""
    ys, xs = np.mgrid[0:height, 0:width] / max(height, width)
    pixels = np.stack([ys, xs, 1 - (ys + xs) / 2], axis=-1)
    pixels = np.clip(pixels + 0.1 * np.random.default_rng(7).standard_normal(pixels.shape), 0, 1)
    return Image.fromarray((pixels * 255).astype(np.uint8))


def request(**kwargs) -> GenerateRequest:
    base = {"prompt": "make the fox red", "negative_prompt": " ", "guidance": 4.0, "steps": 2, "seed": 3}
    return GenerateRequest(image=picture(), **(base | kwargs))


def check_edit(edit, height: int, width: int) -> None:
    want, got = (generate(p, request(height=height, width=width), output_type="np").images[0] for p in edit[1:])
    psnr = psnr_db(got, want)
    print(f"tiny-qwen-image-edit {height}x{width}: PSNR {psnr:.1f} dB")
    assert want.shape == (height, width, 3) and want.std() > 0.01 and psnr >= 35.0


def test_every_network_is_an_engine_standin(edit):
    _, reference, engine = edit
    assert_edit_networks(engine)
    assert type(engine).__name__ == type(reference).__name__ == "QwenImageEditPipeline"


def assert_edit_networks(engine) -> None:
    """Every network an engine (the VAE encoder too: the condition image's latents), each the Edit pipeline's kind."""
    assert set(assert_every_network_is_an_engine(engine, reads_images=True)) == {"text_encoder", "transformer", "vae"}
    assert isinstance(engine.text_encoder, EngineQwen2_5_VL)
    assert isinstance(engine.transformer, EngineQwenImageTransformer)
    assert isinstance(engine.text_encoder.vision, EngineQwen2_5_VisionTower)  # the LLM engine runs it on the image
    assert isinstance(engine.vae, EngineQwenImageVAE)


def test_an_edit_matches_pytorch(edit):
    """The transformer engine takes the condition image's tokens after the generated ones with the graph it has
    (a dynamic image-token axis, rotary tables the stand-in computes from both img_shapes entries): no Edit graph."""
    shapes = []
    edit[2].transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: shapes.append(kwargs["img_shapes"]), with_kwargs=True
    )
    check_edit(edit, 128, 128)
    # the output's 8×8 patches, then the 4:3 input's condition image, 1184×896 (calculate_dimensions), 74×56 patches
    assert shapes and shapes[0][0] == [(1, 8, 8), (1, 56, 74)]


def test_the_condition_image_sizes_are_the_pipelines():
    """The spec's condition image sizes (written out: the CLI makes specs before diffusers is imported) are diffusers'
    calculate_dimensions of 1024², and an Edit set's profile covers them."""
    import math

    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from sdtrt.spec.qwen_vision import edit_condition_sizes
    from sdtrt.spec.transformer_qwen import edit_condition_patches

    ratios = [1.0] + [math.exp(math.log(3) * (i / 1000 - 1)) for i in range(2001)]
    assert edit_condition_sizes() == tuple(calculate_dimensions(1024 * 1024, r)[:2] for r in ratios)
    assert edit_condition_patches() == (3960, 4096, 4232)


@pytest.mark.parametrize("max_pixels", [12845056, 28 * 28 * 1280, 112 * 112])  # the checkpoints', class default, tiny
def test_the_vision_towers_default_profile_holds_the_processors_condition_images(max_pixels):
    """Each condition image (aspect ratios 1:3 to 3:1) as transformers' processor resizes it within ``max_pixels``:
    its patches within the tower's default profile for that processor, a square one at its opt; the checkpoints'
    processor's tokens are EDIT_IMAGE_TOKENS, the constant the token caps read."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from sdtrt.spec.qwen_vision import QwenVisionTowerSpec, edit_condition_sizes
    from sdtrt.spec.transformer_qwen import EDIT_IMAGE_TOKENS

    tower = QwenVisionTowerSpec(precision="bf16", io_naming="named", vae_scale_factor=1, max_pixels=max_pixels)
    low, opt, high = tower.profile_shapes(tower.default_profile())[tower.input_names[0]]
    patches = []
    for width, height in edit_condition_sizes():
        resized = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=max_pixels)
        patches.append((resized[0] // 14) * (resized[1] // 14))
    print(f"max_pixels {max_pixels}: {min(patches)}..{max(patches)} patches, profile {low[0]}:{opt[0]}:{high[0]}")
    assert low[0] <= min(patches) and max(patches) <= high[0] and patches[0] == opt[0]
    assert max(patches) // 4 <= tower.image_tokens().max
    if max_pixels == 12845056:
        assert opt[0] == 5476 and tower.image_tokens() == EDIT_IMAGE_TOKENS == (4, 1369, 1444)


def edit_folder(folder, preprocessor: dict | None):
    """The preset's folder (symlinked) in ``folder``, its processor/ holding the checkpoints' preprocessor_config.json
    (``preprocessor``; None: the preset's own processor, whose max_pixels is 112²)."""
    import json

    from sdtrt.sources.models import ModelSource, resolve_model

    preset = resolve_model("tiny-qwen-image-edit").path
    for entry in preset.iterdir():
        if entry.name != "processor" or preprocessor is None:
            (folder / entry.name).symlink_to(entry)
    if preprocessor is not None:
        (folder / "processor").mkdir()
        for entry in (preset / "processor").iterdir():
            if entry.name != "processor_config.json":
                (folder / "processor" / entry.name).symlink_to(entry)
        (folder / "processor" / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return ModelSource("tiny-qwen-image-edit-checkpoint-processor", "folder", folder)


# Qwen2.5-VL's preprocessor_config.json, as the Qwen-Image-Edit checkpoints' processor/ folders keep it.
CHECKPOINT_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}  # fmt: skip


@pytest.mark.parametrize(
    ("preprocessor", "tower", "llm", "text"),
    [
        (CHECKPOINT_PREPROCESSOR, (56, 1036, 1064), (69, 1689, 2532), (5, 1625, 2468)),
        (None, (56, 112, 112), (69, 336, 1104), (5, 272, 1040)),  # the preset's processor: 112² at most, 16 tokens
    ],
    ids=["checkpoint-processor", "preset-processor"],
)
def test_an_edit_sets_default_profile_holds_the_pipelines_default_call(tmp_path, preprocessor, tower, llm, text):
    """Without a profile, by the model's own processor config: the vision tower takes its condition images' patches,
    the LLM and the transformer a prompt's 1024 text tokens (and the 64 the LLM's template drops) and its image's;
    the transformer a 1024² output's 4096 patches and a square condition image's 4096 after them; the VAE encoder
    the condition image's sides at any aspect ratio from 1:3 to 3:1."""
    from sdtrt.spec import component_spec

    source = edit_folder(tmp_path, preprocessor)
    vision = component_spec(source, "vision_encoder", "fp32").default_profile()
    assert tuple(vision.height) == tuple(vision.width) == tower
    assert tuple(component_spec(source, "text_encoder", "fp32").default_profile().tokens) == llm
    transformer = component_spec(source, "transformer", "fp32")
    shapes = transformer.profile_shapes(transformer.default_profile())
    assert [shape[1] for shape in shapes["hidden_states"]] == [1024 + 3960, 4096 + 4096, 9216 + 4232]
    assert tuple(shape[1] for shape in shapes["encoder_hidden_states"]) == text
    encoder = component_spec(source, "vae_encoder", "fp32")
    ((low, _, high),) = encoder.profile_shapes(encoder.default_profile()).values()
    assert low[2:] == (512, 512) and high[2:] == (1760, 1760)  # 1760x576 and 576x1760 at 3:1 and 1:3


def test_an_edit_without_its_image_is_refused_before_any_network_runs(edit):
    _, _, engine = edit
    calls = []
    for network in (engine.text_encoder, engine.text_encoder.vision, engine.transformer, engine.vae):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(RequestError, match=r"^this model's pipeline needs an input image[^\n]+$"):
        generate(engine, dataclasses.replace(request(height=128, width=128), image=None))
    assert not calls


def test_a_prompt_its_images_tokens_push_past_the_engines_is_refused_before_any_network_runs(edit):
    """The pre-check counts what the LLM engine will read: the chat template, the prompt and the image's vision
    tokens as the pipeline's own processor writes them (its condition image, calculate_dimensions' ~1024², cut by
    the processor within its max_pixels), not the template's one image-pad token. A prompt that fits the engines
    without its image's tokens and not with them is refused in one line before the tower runs; one at the limit
    with them is taken."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from sdtrt.pipeline.token_limits import llm_kwargs

    _, _, engine = edit
    image = picture()  # 96x128: a 1184x896 condition image, 84x112 pixels after the processor, 12 vision tokens
    width, height, _ = calculate_dimensions(1024 * 1024, image.width / image.height)
    condition = image.resize((width, height))
    profiles = (engine.text_encoder.runtime.profile, engine.transformer.runtime.profile)
    limit = min(profiles[0].tokens.max, profiles[1].tokens.max + 64)  # the transformer reads the 64 it drops fewer

    def counts(prompt: str) -> tuple[int, int]:
        """The prompt's tokens with its template: its text alone, and as the processor writes it with the image."""
        text = engine.prompt_template_encode.format(prompt)
        with_image = engine.processor(text=[text], images=[condition], return_tensors="pt")["input_ids"].shape[1]
        return len(engine.tokenizer(text).input_ids), with_image

    fewest, most = 1, limit  # bisected: the fewest words whose prompt, with its image, the engines cannot take
    while fewest < most:
        middle = (fewest + most) // 2
        fewest, most = (fewest, middle) if counts("a " * middle)[1] > limit else (middle + 1, most)
    words = fewest
    prompt = "a " * words
    text_tokens, tokens = counts(prompt)
    assert text_tokens <= limit < tokens  # the template's image pad alone: it fitted
    calls = []
    for network in (engine.text_encoder, engine.text_encoder.vision, engine.transformer, engine.vae):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(
        RequestError,
        match=rf"^[^\n]* is {tokens} tokens with its chat template and its 12 image tokens"
        rf"[^\n]*more than the {limit} \(\d+\.\.{limit}\) the engines were built for; shorten it",
    ):
        generate(engine, request(prompt=prompt, height=128, width=128))
    assert not calls
    fits = next(p for p in ("a " * (words - n) for n in range(1, 4)) if counts(p)[1] <= limit)
    assert llm_kwargs(engine, [fits, " "], image) == {"max_sequence_length": min(limit - 64, 1024)}


@pytest.fixture(scope="module")
def inpaint(edit):
    """(PyTorch, engine) QwenImageEditInpaintPipeline over the Edit pipelines' components (`--task inpaint`)."""
    from sdtrt.pipeline.loading import task_pipelines

    return tuple(task_pipelines(pipe, {"inpaint": "QwenImageEditInpaintPipeline"})["inpaint"] for pipe in edit[1:])


@pytest.mark.slow  # ~1024² outputs: 1-2 min a size on 2 cores
@pytest.mark.parametrize("size", [(96, 96), (96, 128)], ids=["square", "non-square"])
def test_an_edit_inpaint_matches_pytorch(inpaint, size):
    """QwenImageEditInpaintPipeline repaints its image where the mask is white at the condition image's size (1024²
    for a square input, 1184×896 for a 4:3 one, whatever the height asked): the transformer engine reads the output's
    tokens and the condition image's, as many, the VAE encoder engine the image and the masked image."""
    assert type(inpaint[1]).__name__ == "QwenImageEditInpaintPipeline"
    assert_edit_networks(inpaint[1])
    req = dataclasses.replace(request(mask_image=centre_mask(*size)), image=picture(*size))
    want, got = (generate(p, req, output_type="np").images[0] for p in inpaint)
    psnr = psnr_db(got, want)
    made = {(96, 96): (1024, 1024), (96, 128): (896, 1184)}[size]
    print(f"tiny-qwen-image-edit inpaint {made[0]}x{made[1]}: PSNR {psnr:.1f} dB")
    assert want.shape == (*made, 3) and want.std() > 0.01 and psnr >= 35.0


def test_an_edit_inpaint_without_its_mask_or_at_another_size_is_refused_before_running(edit, inpaint):
    """Each in one line before any network runs: no mask (the library's generate), and a height that is not the one
    the pipeline makes (the CLI's check, shared with the Triton model)."""
    from sdtrt.pipeline.image_inputs import sized_by_image

    engine, pipeline = inpaint[1], "QwenImageEditInpaintPipeline"
    calls = []
    networks = (engine.text_encoder, engine.text_encoder.vision, engine.transformer, engine.vae)
    hooks = [network.register_forward_pre_hook(lambda *_: calls.append(1)) for network in networks]
    try:
        with pytest.raises(RequestError, match=r"^[^\n]*needs a mask image[^\n]*$"):
            generate(engine, request(height=128, width=128))
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls
    req = request(height=128, mask_image=centre_mask(96, 128))
    assert sized_by_image(dataclasses.replace(req, height=None), pipeline, 16).height == 896
    made = r"^the pipeline makes 1184×896 px \(w×h\) of the input image's aspect ratio \(about 1024² px"
    with pytest.raises(RequestError, match=made + r"[^\n]+leave the height and width out$"):
        sized_by_image(req, pipeline, 16)
    wide = dataclasses.replace(req, image=picture(100, 300), height=None)  # 3:1: 1760×576, wider than PROFILE
    with pytest.raises(RequestError, match=r"^the pipeline makes 1760×576 px[^\n]+use an image nearer square"):
        sized_by_image(wide, pipeline, 16, PROFILE)


@pytest.mark.slow
def test_a_non_square_edit_matches_pytorch(edit):
    check_edit(edit, 128, 192)


def plus_folder(folder):
    """The preset as a QwenImageEditPlusPipeline folder (Qwen-Image-Edit-2509's), symlinked into ``folder``."""
    import json

    from sdtrt.sources.models import ModelSource, resolve_model

    preset = resolve_model("tiny-qwen-image-edit").path
    for entry in preset.iterdir():
        if entry.name != "model_index.json":
            (folder / entry.name).symlink_to(entry)
    index = json.loads((preset / "model_index.json").read_text()) | {"_class_name": "QwenImageEditPlusPipeline"}
    (folder / "model_index.json").write_text(json.dumps(index))
    return ModelSource("tiny-qwen-image-edit-plus", "folder", folder)


def test_the_plus_pipelines_tower_profile_holds_its_three_condition_images(tmp_path):
    """QwenImageEditPlusPipeline gives the tower up to three images at once, each about 384² (diffusers'
    CONDITION_IMAGE_SIZE) before the processor: their patches together fit the tower's default profile, a square
    one's at its opt."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from sdtrt.spec import component_spec

    tower = component_spec(plus_folder(tmp_path), "vision_encoder", "fp32")
    low, opt, high = (shape[0] for shape in tower.profile_shapes(tower.default_profile())[tower.input_names[0]])
    patches = []
    for ratio in (1.0, 3.0, 1 / 3, 4 / 3):
        width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)
        resized = smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=112 * 112)  # the preset's
        patches.append((resized[0] // 14) * (resized[1] // 14))
    print(f"Plus tower profile {low}:{opt}:{high} patches; one image {patches}")
    assert patches[0] == opt and low <= min(patches) and 3 * max(patches) <= high


@pytest.mark.parametrize(
    ("plus", "count", "refusal"),
    [
        (False, 2, "QwenImageEditPipeline takes 1 --image, not 2: pass one (QwenImageEditPlusPipeline takes up to 3)"),
        (True, 4, "QwenImageEditPlusPipeline takes at most 3 --image, not 4: pass at most 3"),
    ],
    ids=["edit-two", "plus-four"],
)
def test_more_images_than_the_pipeline_takes_are_refused_before_loading(tmp_path, plus, count, refusal):
    """`sdtrt generate --image` repeated: more than the Edit pipeline's one or the Plus pipeline's three refused in
    one line (exit 2) before anything loads."""
    from tests.helpers import run_cli

    (tmp_path / "model").mkdir()
    model = str(plus_folder(tmp_path / "model").path) if plus else "tiny-qwen-image-edit"
    picture().save(tmp_path / "in.png")
    images = [arg for _ in range(count) for arg in ("--image", str(tmp_path / "in.png"))]
    result = run_cli("generate", "--model", model, *images, "--prompt", "a fox", "--out", str(tmp_path / "o.png"))
    assert result.returncode == 2 and refusal in result.stderr and not (tmp_path / "o.png").exists(), result.stderr


@pytest.mark.slow
def test_sdtrt_generate_edits_two_images_on_the_plus_pipelines_engines(store, tmp_path):
    """`sdtrt generate --image a.png --image b.png` on a Plus set: both images reach the pipeline (the prompt check
    counts both images' vision tokens and its Picture-n text), and the PNG is the size asked."""
    from sdtrt.tools.compile import compile_model
    from tests.helpers import run_cli

    (tmp_path / "model").mkdir()
    source = plus_folder(tmp_path / "model")
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine = compile_model(source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE).final
    picture().save(tmp_path / "a.png")
    picture(128, 96).save(tmp_path / "b.png")
    result = run_cli(
        "generate", "--engine", str(engine.path), "--model", str(source.path), "--image", str(tmp_path / "a.png"),
        "--image", str(tmp_path / "b.png"), "--prompt", "put the fox in the second picture", "--negative-prompt",
        " ", "--guidance", "4", "--steps", "2", "--height", "128", "--width", "192", "--out", str(tmp_path / "o.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert Image.open(tmp_path / "o.png").size == (192, 128)


@pytest.mark.slow
def test_the_plus_pipeline_edits_two_images_on_its_engines(store, tmp_path):
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's: several input images, each a ~1024² condition image for the
    VAE and the transformer, a 384² one for the vision tower) on a set of the preset as a Plus folder, whose
    transformer takes up to three condition images' patches: two images as PyTorch's."""
    from sdtrt.tools.compile import compile_model

    source = plus_folder(tmp_path)
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine = compile_model(source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE).final
    pipes = [load_pipeline(source), load_pipeline(source, engine)]
    assert all(type(p).__name__ == "QwenImageEditPlusPipeline" for p in pipes)
    assert_edit_networks(pipes[1])
    patches = []  # both images' patches reach the tower engine
    pipes[1].text_encoder.vision.register_forward_pre_hook(lambda _, args: patches.append(args[0].shape[0]))
    call = {"prompt": "put the fox in the second picture", "negative_prompt": " ", "true_cfg_scale": 4.0,
            "height": 128, "width": 192, "num_inference_steps": 2, "output_type": "np"}  # fmt: skip
    images = [picture(), picture(128, 96)]
    for width in (192, 128):
        call["width"] = width
        want, got = (p(image=images, generator=torch.Generator().manual_seed(3), **call).images[0] for p in pipes)
        psnr = psnr_db(got, want)
        print(f"tiny-qwen-image-edit as QwenImageEditPlusPipeline, two images, 128x{width}: PSNR {psnr:.1f} dB")
        assert want.shape == (128, width, 3) and want.std() > 0.01 and psnr >= 35.0
    assert patches and all(n > 64 for n in patches), patches  # more than one image's most: 8 × 8 at 112²


def test_the_saved_processor_names_the_stock_class_and_sdtrt_reloads_it(tmp_path):
    """A processor sdtrt saves names transformers' Qwen2VLProcessor (the class Edit checkpoints name; no transformers
    class is named ImageQwen2VLProcessor, so a stock AutoProcessor could not load it), in processor_config.json and
    the tokenizer's config; sdtrt reloads that folder without torchvision, and it writes an image's tokens as before.
    (Stock transformers' Qwen2VLProcessor itself needs torchvision, not installed here.)"""
    import json

    import transformers
    from transformers.video_processing_utils import BaseVideoProcessor

    from sdtrt.sources.models import resolve_model
    from sdtrt.sources.qwen_processor import TINY_PIXELS, edit_processor, new_edit_processor

    preset = resolve_model("tiny-qwen-image-edit").path
    tokenizer = transformers.AutoTokenizer.from_pretrained(preset / "processor")
    new_edit_processor(tokenizer, TINY_PIXELS).save_pretrained(tmp_path / "processor")
    for name in ("processor_config.json", "tokenizer_config.json"):
        named = json.loads((tmp_path / "processor" / name).read_text())["processor_class"]
        assert named == "Qwen2VLProcessor" and getattr(transformers, named) is transformers.Qwen2VLProcessor
    # what stock loading reads of the video processor (without it: OSError "Can't load video processor")
    video, _ = BaseVideoProcessor.get_video_processor_dict(tmp_path / "processor")
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    processor = edit_processor("QwenImageEditPipeline", tmp_path)["processor"]
    assert type(processor).__name__ == "ImageQwen2VLProcessor"
    (tmp_path / "model_index.json").symlink_to(preset / "model_index.json")
    text = "<|vision_start|><|image_pad|><|vision_end|>a fox"
    ids = processor(text=[text], images=[picture(112, 112)], return_tensors="pt")["input_ids"]
    assert (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum() == 16  # 112²: 8×8 patches, 2×2 a token
