"""Qwen-Image-Edit's text encoder on engines (issue 38: the Edit pipelines run their input image through
Qwen2.5-VL): the vision tower as its own engine, exported from the text encoder's folder, and the LLM engine that
takes its image embeddings, both built for ONNX Runtime in fp32 and checked against PyTorch's fp32 text encoder.

The tower, in ``model.visual`` where ``get_image_features`` calls it: the merged embeddings of real processor patches
for one non-square image and for two images of two sizes in one call. The LLM engine, beside the tower: two padded
prompts with an image each, called as QwenImageEditPipeline calls its text encoder.

The model is tiny-qwen-image as a QwenImageEditPipeline folder, its text encoder with the vision tokens and a
two-block tower (one windowed block, one over each frame), so both masks and the window reordering run: a 112×168
image is 4×6 merged tokens, two windows of 4×4 (one padded).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor

from sdtrt.core.config import ExportConfig, Range, ShapeProfile, SimplifyConfig
from sdtrt.core.errors import EngineInputError, UnsupportedModelError

# One or two images, each 56 to 168 pixels a side (the processor's multiples of 28); prompts of up to 80 tokens past
# the 64 the Edit pipeline's template drops.
PROFILE = ShapeProfile(Range(1, 1, 2), Range(56, 112, 168), Range(56, 168, 168), False, Range(1, 40, 80))
VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
TOWER = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, fullatt_block_indexes=[1])


@pytest.fixture(scope="module")
def vision(store, tmp_path_factory):
    """A Qwen-Image folder whose text encoder has the two-block tower, its PyTorch text encoder, the vision tower
    engine's stand-in and a slow image processor (torchvision's fast one is not installed)."""
    from sdtrt.runtime import open_runtime
    from sdtrt.standins.qwen_vision import EngineQwen2_5_VisionTower
    from sdtrt.tools.compile import compile_model

    source, encoder = vision_folder(tmp_path_factory.mktemp("qwen-vision"))
    config = ExportConfig(precision="fp32", exporter="torchscript")
    built = compile_model(
        source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE,
        components=("vision_encoder",),
    ).final  # fmt: skip
    tower = EngineQwen2_5_VisionTower(open_runtime(built), encoder.config.vision_config, dtype=torch.float32)
    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=168 * 168)
    return source, encoder, tower, processor


def vision_folder(folder, tower=TOWER):
    """tiny-qwen-image as a QwenImageEditPipeline folder (its processor left out: transformers' Qwen2VLProcessor
    cannot be made without torchvision), its text encoder with the ``tower`` (the two-block one) and the image
    tokens, written into ``folder``: the source, and the text encoder."""
    import json

    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from sdtrt.sources.models import ModelSource, resolve_model
    from sdtrt.sources.presets import TINY_QWEN25_VL
    from sdtrt.sources.qwen_encoder import qwen_vl_config

    preset = resolve_model("tiny-qwen-image")
    for entry in preset.path.iterdir():
        if entry.name not in ("text_encoder", "tokenizer", "model_index.json"):
            (folder / entry.name).symlink_to(entry)
    index = json.loads((preset.path / "model_index.json").read_text()) | {"_class_name": "QwenImageEditPipeline"}
    (folder / "model_index.json").write_text(json.dumps(index))
    tokenizer = AutoTokenizer.from_pretrained(preset.path / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS}, replace_extra_special_tokens=False)
    tokenizer.save_pretrained(folder / "tokenizer")
    config = qwen_vl_config(tokenizer, TINY_QWEN25_VL | {"vision_config": tower})
    config.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    torch.manual_seed(0)
    encoder = Qwen2_5_VLForConditionalGeneration(config)
    encoder.eval().save_pretrained(folder / "text_encoder")
    return ModelSource("tiny-qwen-vision", "folder", folder), encoder


def pictures(*sizes: tuple[int, int]) -> list[Image.Image]:
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


@pytest.mark.parametrize("sizes", [[(112, 168)], [(112, 168), (56, 84)]], ids=["one-112x168", "two-sizes"])
def test_the_vision_tower_engine_matches_pytorch(vision, sizes):
    _, encoder, tower, processor = vision
    check_tower(encoder, tower, processor, sizes)


@pytest.mark.slow
def test_the_default_export_matches_pytorch(vision, store):
    """Compiled the default way: torch.export's exporter on a weight-free trace, the tower's weights streamed from
    the text encoder's safetensors (the language model's never read)."""
    from sdtrt.runtime import open_runtime
    from sdtrt.standins.qwen_vision import EngineQwen2_5_VisionTower
    from sdtrt.tools.compile import compile_model

    source, encoder, _, processor = vision
    built = compile_model(
        source, store, "onnxruntime", ExportConfig(precision="fp32"), SimplifyConfig(check=False), profile=PROFILE,
        components=("vision_encoder",),
    ).final  # fmt: skip
    tower = EngineQwen2_5_VisionTower(open_runtime(built), encoder.config.vision_config, dtype=torch.float32)
    check_tower(encoder, tower, processor, [(112, 168), (56, 84)])


def check_tower(encoder, tower, processor, sizes: list[tuple[int, int]]) -> None:
    """The text encoder's get_image_features with the stand-in in model.visual against its PyTorch tower's."""
    inputs = processor(images=pictures(*sizes), return_tensors="pt")
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.no_grad():
        want = encoder.model.get_image_features(pixels, grid).pooler_output
        pytorch_tower = encoder.model.visual
        encoder.model.visual = tower  # where get_image_features calls it
        try:
            got = encoder.model.get_image_features(pixels, grid).pooler_output
        finally:
            encoder.model.visual = pytorch_tower
    assert [t.shape for t in got] == [t.shape for t in want]
    error = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    print(f"vision tower engine, images {sizes}: grids {grid.tolist()}, max |error| {error:.2e}")
    assert error < 1e-4 and all(float(w.std()) > 1e-3 for w in want)


def test_inputs_the_vision_tower_engine_cannot_take_are_refused(vision):
    tower = vision[2]
    grid = torch.tensor([[1, 8, 12]])
    with pytest.raises(EngineInputError, match="10 values a patch; this vision tower engine takes 1176"):
        tower(torch.zeros(96, 10), grid)
    with pytest.raises(EngineInputError, match="output_attentions"):
        tower(torch.zeros(96, 1176), grid, output_attentions=True)


def test_a_vision_tower_is_refused_for_a_model_without_qwen_vl(store):
    """SD's CLIP text encoder has no vision tower: refused in one line before any export."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    with pytest.raises(UnsupportedModelError, match="from a Qwen2_5_VLForConditionalGeneration, not from a CLIPText"):
        compile_model(resolve_model("tiny"), store, "onnxruntime", components=("vision_encoder",))


@pytest.fixture(scope="module")
def edit_encoder(vision, store):
    """The Edit folder's text encoder as engines, as the pipeline loader makes its stand-ins: the LLM engine that
    takes image embeddings, the vision tower beside it; and the PyTorch text encoder."""
    from sdtrt.pipeline.loading import standins
    from sdtrt.spec import QwenVLImageEncoderSpec
    from sdtrt.stages.engine_set import engine_members
    from sdtrt.standins.llm_encoder import EngineQwen2_5_VL
    from sdtrt.standins.qwen_vision import EngineQwen2_5_VisionTower
    from sdtrt.tools.compile import compile_model

    source, encoder, _, _ = vision
    config = ExportConfig(precision="fp32", exporter="torchscript")
    built = compile_model(
        source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE,
        components=("text_encoder", "vision_encoder"),
    ).final  # fmt: skip
    engine = standins(source, engine_members(built), None, torch.float32)["text_encoder"]
    assert isinstance(engine, EngineQwen2_5_VL) and isinstance(engine.spec, QwenVLImageEncoderSpec)
    assert isinstance(engine.vision, EngineQwen2_5_VisionTower)
    assert set(engine.engine_paths) == {"text_encoder", "vision_encoder"}  # what its save_pretrained names
    return encoder, engine


def prompts_with_images(source, processor, sizes, text_lengths):
    """A right-padded batch as the Edit pipeline's processor makes it: each row some text, one image's vision-start,
    image-pad tokens (one a merged 2×2 patch group) and vision-end, more text; the images' patches and grids."""
    from transformers import AutoTokenizer

    start, pad, end = AutoTokenizer.from_pretrained(source.path / "tokenizer").convert_tokens_to_ids(VISION_TOKENS)
    images = processor(images=pictures(*sizes), return_tensors="pt")
    rows = []
    for (before, after), grid in zip(text_lengths, images["image_grid_thw"], strict=True):
        count = int(grid.prod()) // 4
        rows.append([5 + i % 200 for i in range(before)] + [start] + [pad] * count + [end] + [7] * after)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask, images["pixel_values"], images["image_grid_thw"]


def test_the_llm_engine_on_prompts_with_images_matches_pytorch(vision, edit_encoder):
    """Two prompts of two lengths, each with an image of its own size, called as QwenImageEditPipeline calls its text
    encoder: the engine's last hidden states on every token the pipeline keeps are PyTorch's."""
    source, _, _, processor = vision
    encoder, engine = edit_encoder
    ids, mask, pixels, grid = prompts_with_images(source, processor, [(112, 168), (56, 84)], [(40, 10), (30, 5)])
    call = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grid}
    with torch.no_grad():
        want = encoder(**call, output_hidden_states=True).hidden_states[-1]
    got = engine(**call, output_hidden_states=True).hidden_states[-1]
    kept = mask.bool()
    error = float((got[kept] - want[kept]).abs().max())
    print(f"LLM engine with images, prompts of {kept.sum(1).tolist()} tokens: max |error| {error:.2e}")
    assert got.shape == want.shape and error < 1e-4 and float(want[kept].std()) > 1e-3


def test_an_image_engine_without_its_image_is_refused(edit_encoder):
    """In one line, and before the vision tower runs: a call without its image, and one the engine cannot give."""
    _, engine = edit_encoder
    ids = torch.ones(1, 70, dtype=torch.int64)
    runs = []
    engine.vision.register_forward_pre_hook(lambda *_: runs.append(1))
    with pytest.raises(EngineInputError, match=r"^this Qwen2.5-VL engine was built for a prompt with an image"):
        engine(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    image = {"pixel_values": torch.zeros(96, 1176), "image_grid_thw": torch.tensor([[1, 8, 12]])}
    with pytest.raises(EngineInputError, match=r"^output_hidden_states=False: [^\n]+$"):
        engine(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=False, **image)
    assert not runs


def test_image_tokens_that_are_not_one_an_embedding_are_refused(vision, edit_encoder):
    """A prompt with one image token fewer or more than its image's embeddings: refused in one line, as transformers
    refuses it, before the tower (and so the LLM) runs, not a Gather error or embeddings silently dropped."""
    source, _, _, processor = vision
    _, engine = edit_encoder
    ids, mask, pixels, grid = prompts_with_images(source, processor, [(112, 168)], [(10, 5)])
    pad = int(ids[0, 11])  # the first image token, after 10 of text and the vision-start
    runs = []
    hook = engine.vision.register_forward_pre_hook(lambda *_: runs.append(1))
    fewer, more = ids.clone(), ids.clone()
    fewer[0, 11] = 7  # an image token made text
    more[0, 2] = pad  # a text token made an image token
    for changed, count in ((fewer, 23), (more, 25)):
        call = {"input_ids": changed, "attention_mask": mask, "pixel_values": pixels, "image_grid_thw": grid}
        with pytest.raises(
            EngineInputError, match=rf"^the prompts hold {count} image tokens and their images make 24 "
        ):
            engine(**call, output_hidden_states=True)
    hook.remove()
    assert not runs


@pytest.mark.parametrize("aspect", [(1, 1), (16, 9), (4, 3)], ids=["square", "16x9", "4x3"])
def test_the_edit_llm_default_profile_holds_the_pipeline_default_prompt(aspect):
    """The Edit pipeline's own condition image (its calculate_dimensions of 1024² pixels), through the slow processor
    at its default max_pixels: its tokens, the 64 the template drops and a prompt of the pipeline's whole text cap fit
    the LLM engine's default profile and its token cap; and the vision tower's default profile takes its patches."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from sdtrt.core.families import LLM_TOKENS, QWEN_IMAGE_EDIT_DROPPED_TOKENS
    from sdtrt.spec import QwenVisionTowerSpec, QwenVLImageEncoderSpec

    width, height, _ = calculate_dimensions(1024 * 1024, aspect[0] / aspect[1])
    grid = Qwen2VLImageProcessor()(images=Image.new("RGB", (width, height)), return_tensors="pt")["image_grid_thw"]
    patches = int(grid.prod())
    tower = QwenVisionTowerSpec(precision="bf16", io_naming="named", vae_scale_factor=1)
    llm = QwenVLImageEncoderSpec(precision="bf16", io_naming="named", vae_scale_factor=8)
    most_patches = tower.profile_shapes(tower.default_profile())[tower.input_names[0]][2][0]
    tokens = llm.default_profile().tokens
    prompt = QWEN_IMAGE_EDIT_DROPPED_TOKENS + patches // 4 + LLM_TOKENS["qwenimage"]
    print(f"{width}x{height} condition image: {patches} patches, a full prompt {prompt} tokens; profile {tokens}")
    assert patches <= most_patches and tokens is not None
    assert tokens.opt >= QWEN_IMAGE_EDIT_DROPPED_TOKENS + patches // 4 and prompt <= tokens.max <= llm.token_cap.most
    llm.check_profile(llm.default_profile())


def test_the_validation_cases_of_both_engines_match_pytorch(vision, edit_encoder):
    """What `sdtrt validate` compares member by member, on each spec's seeded cases: the LLM engine against the
    PyTorch text encoder given the same embeddings (mm_encoder_outputs), the tower against its graph's wrapper."""
    from sdtrt.tools.validate import compare_case

    encoder, engine = edit_encoder
    for runtime in (engine.runtime, engine.vision.runtime):
        spec = runtime.spec
        for case in spec.validation_cases(spec.member_profile(PROFILE)):
            row = compare_case(runtime, encoder, spec, case)
            print(f"{spec.label} {row['case']}: cosine {row['cosine']:.8f}, max |error| {row['max_abs']:.2e}")
            assert row["finite"] and row["cosine"] > 0.99999 and row["max_abs"] < 1e-4


@pytest.mark.parametrize("full", [[0], []], ids=["every-block-full", "no-block-full"])
def test_a_tower_of_one_attention_kind_exports_and_matches_pytorch(store, tmp_path, full):
    """A one-block tower whose block attends over each frame (fullatt_block_indexes covers every block), or within
    windows: its graph takes the one segment input its block reads (an exporter drops the other), and the engine
    matches PyTorch on a two-window image."""
    from sdtrt.runtime import open_runtime
    from sdtrt.spec import QwenVisionTowerSpec
    from sdtrt.standins.qwen_vision import EngineQwen2_5_VisionTower
    from sdtrt.tools.compile import compile_model

    source, encoder = vision_folder(tmp_path, dict(TOWER, depth=1, fullatt_block_indexes=full))
    built = compile_model(
        source, store, "onnxruntime", ExportConfig(precision="fp32", exporter="torchscript"),
        SimplifyConfig(check=False), profile=PROFILE, components=("vision_encoder",),
    ).final  # fmt: skip
    runtime = open_runtime(built)
    assert isinstance(runtime.spec, QwenVisionTowerSpec)
    assert runtime.spec.input_names[3:] == (("frame_segments",) if full else ("window_segments",))
    tower = EngineQwen2_5_VisionTower(runtime, encoder.config.vision_config, dtype=torch.float32)
    check_tower(encoder, tower, Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=168 * 168), [(112, 168)])
