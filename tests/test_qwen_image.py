"""Qwen-Image (issue 38) on an engine set: the Qwen2.5-VL LLM text encoder's text path, the QwenImage MMDiT and the
causal 3D VAE's decoder on one frame each an engine stand-in, images as the PyTorch fp32 QwenImagePipeline's with
true classifier-free guidance (a negative prompt: two transformer passes a step), a batch of two prompts of two
lengths (padded masks), and a prompt over the LLM engine's tokens refused with one line before anything runs.

One fp32 ONNX Runtime engine set, shared by the module's tests, kept cheap: TorchScript's exporter, a profile of the
two test sizes, no VAE encoder (txt2img never encodes); ``-m slow`` compiles the default way (torch.export's
exporter for the transformer, every network).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ExportConfig, Range, ShapeProfile, SimplifyConfig, ValidationConfig
from sdtrt.core.errors import ConfigError, EngineInputError, RequestError
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.standins.llm_encoder import EngineQwen2_5_VL
from sdtrt.standins.transformer import EngineQwenImageTransformer
from sdtrt.standins.vae_qwen import EngineQwenImageVAE
from sdtrt.tools.image_quality import psnr_db

from .helpers import assert_every_network_is_an_engine, dropped_parameters, stored_parameters

# The test sizes, one or two prompts, and 1 to 256 prompt tokens the transformer reads (the LLM engine 34 more: the
# template's first, which the pipeline drops; the offline tokenizer spells the pipeline's system prompt out in about
# 150 tokens).
PROFILE = ShapeProfile(Range(1, 1, 2), Range(128, 128, 128), Range(128, 192, 192), False, Range(1, 160, 256))
TXT2IMG = ("text_encoder", "transformer", "vae_decoder")
STEPS = 10  # the step caches' test: enough steps for First-Block Cache to skip some


@pytest.fixture(scope="module")
def qwen(store):
    """The preset, and its (PyTorch fp32, engine) pipelines."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-qwen-image")
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine = compile_model(
        source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE, components=TXT2IMG
    ).final
    return source, load_pipeline(source), load_pipeline(source, engine)


def request(**kwargs) -> GenerateRequest:
    base = {"prompt": "a red fox in the snow", "negative_prompt": "blurry", "guidance": 4.0, "steps": 2, "seed": 3}
    return GenerateRequest(**(base | kwargs))


@pytest.fixture(scope="module")
def cached(qwen, store):
    """The PyTorch pipeline, and the engine pipeline of the module's set with the step caches' split members
    (``--caches first-block``: the other members are the module's, cache hits)."""
    from sdtrt.tools.compile import compile_model

    source, reference, _ = qwen
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine = compile_model(
        source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=PROFILE, components=TXT2IMG,
        caches=("first-block",),
    ).final  # fmt: skip
    return reference, load_pipeline(source, engine)


def counted(module: torch.nn.Module) -> list[int]:
    """How many times ``module`` runs (a PyTorch block's MLP: skipped with its block), as a one-item list."""
    runs = [0]
    module.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


def cached_image(pipe, config=None, prompt: str | list[str] = "a red fox in the snow", **call) -> np.ndarray:
    if config is not None:
        pipe.transformer.enable_cache(config)
    try:
        call = {"num_inference_steps": STEPS, "height": 128, "width": 128, "output_type": "np"} | call
        return pipe(prompt, generator=torch.Generator().manual_seed(0), **call).images
    finally:
        if config is not None:
            pipe.transformer.disable_cache()


def test_step_caches_on_the_engines_skip_the_steps_diffusers_skips(cached, decisions):
    """First-Block Cache and TaylorSeer lite on the transformer's parts (its text mask and rotary angles handed to
    each block) against the same configs on the PyTorch pipeline: the same decisions, as many runs of the blocks
    after the first (the PyTorch last block's, the engines' other-blocks part), the same image."""
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    reference, engines = cached
    uncached = cached_image(engines)
    pytorch_runs = counted(reference.transformer.transformer_blocks[-1].img_mlp)
    rest = engines.transformer.opened_split().rest
    taylorseer = TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=2, use_lite_mode=True, taylor_factors_dtype=torch.float32
    )
    for config in (FirstBlockCacheConfig(threshold=0.5), taylorseer):
        decisions.clear()
        before = pytorch_runs[0]
        expected = cached_image(reference, config)
        on_pytorch, runs = "".join(decisions), pytorch_runs[0] - before
        decisions.clear()
        before = rest.calls
        image = cached_image(engines, config)
        assert "".join(decisions) == on_pytorch and rest.calls - before == runs < STEPS, (config, on_pytorch, runs)
        assert psnr_db(image, expected) >= 35.0, config
        assert psnr_db(image, uncached) < 80.0, config  # steps were skipped
    assert np.array_equal(cached_image(engines), uncached)  # disable_cache: the whole engine again, bit for bit


def test_step_caches_take_padded_text_masks_and_the_negative_prompt_s_context(cached, decisions):
    """Two prompts of two lengths (a text mask with zeros reaches the block parts) and a negative prompt each (true
    CFG: the pipeline's "uncond" cache context beside "cond", each with its own cached residuals): the engines make
    PyTorch's decisions on both passes of every step, and each image is PyTorch's."""
    from diffusers.hooks import FirstBlockCacheConfig

    reference, engines = cached
    masks: list[torch.Tensor] = []
    first = engines.transformer.opened_split().first
    first.register_forward_pre_hook(lambda _m, _a, kw: masks.append(kw["encoder_hidden_states_mask"]), with_kwargs=True)
    call = {"prompt": ["a red fox in the snow", "a cat"], "negative_prompt": ["blurry", "ugly"], "true_cfg_scale": 4.0}
    config = FirstBlockCacheConfig(threshold=0.5)
    expected = cached_image(reference, config, **call)
    on_pytorch = "".join(decisions)
    decisions.clear()
    images = cached_image(engines, config, **call)
    made = "".join(decisions)
    assert made == on_pytorch and len(made) == 2 * STEPS and "s" in made, (made, on_pytorch)
    assert any(not bool(m.all()) for m in masks)  # a padded mask went through the parts
    for got, want in zip(images, expected, strict=True):
        psnr = psnr_db(got, want)
        print(f"tiny-qwen-image First-Block Cache, two prompts with negative prompts: {made}, PSNR {psnr:.1f} dB")
        assert psnr >= 35.0


def test_every_network_is_an_engine_standin(qwen):
    _, reference, engine = qwen
    assert set(assert_every_network_is_an_engine(engine)) == {"text_encoder", "transformer", "vae"}
    assert isinstance(engine.text_encoder, EngineQwen2_5_VL)
    assert isinstance(engine.transformer, EngineQwenImageTransformer)
    assert isinstance(engine.vae, EngineQwenImageVAE) and engine.vae.decoder_runtime is not None
    assert engine.vae_scale_factor == reference.vae_scale_factor == 8
    assert engine.vae.config.latents_std == reference.vae.config.latents_std  # the pipeline normalises with them


def test_txt2img_matches_pytorch(qwen):
    reference, engine = (generate(p, request(height=128, width=128), output_type="np").images[0] for p in qwen[1:])
    psnr = psnr_db(engine, reference)
    print(f"tiny-qwen-image txt2img 128x128: PSNR {psnr:.1f} dB")
    assert reference.shape == (128, 128, 3) and reference.std() > 0.01 and psnr >= 35.0


def test_a_prompt_over_the_llm_engines_tokens_is_refused_before_running(qwen):
    _, _, engine = qwen
    calls = []
    for network in (engine.text_encoder, engine.transformer, engine.vae):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(
        RequestError,
        match=r"tokens with its chat template \(\d+ once the pipeline drops the "
        r"template's first 34\), more than the 290 the engines",
    ) as error:
        generate(engine, request(prompt="astronaut " * 80, height=128, width=128))
    assert "\n" not in str(error.value) and not calls


def test_a_batch_of_two_prompts_of_two_lengths_matches_pytorch(qwen):
    """Two requests in one call, their prompts of different lengths, at a non-square size: the LLM's padding mask
    reaches the transformer engine with zeros, and each image is PyTorch's."""
    _, reference, engine = qwen
    masks = []
    engine.transformer.register_forward_pre_hook(
        lambda _m, _a, kwargs: masks.append(kwargs["encoder_hidden_states_mask"]), with_kwargs=True
    )
    size = {"height": 128, "width": 192}
    batch = [request(**size), request(prompt="a cat", negative_prompt="ugly", seed=4, **size)]
    images = [generate(p, batch, output_type="np").images for p in (reference, engine)]
    assert any(m is not None and not bool(m.all()) for m in masks)  # a padded mask ran
    for got, want in zip(images[1], images[0], strict=True):
        psnr = psnr_db(got, want)
        print(f"tiny-qwen-image txt2img, a batch of two, 128x192: PSNR {psnr:.1f} dB")
        assert got.shape == (128, 192, 3) and want.std() > 0.01 and psnr >= 35.0


def test_the_default_profile_compiles(qwen, store):
    """Without a profile (`sdtrt compile` without --tokens): Qwen-Image's 1024 prompt tokens at most, the LLM's 34
    more, each within its own pipeline's cap, not T5's 512; built from the module's exports."""
    from sdtrt.cli.build_options import shape_profile
    from sdtrt.spec import QwenImageTransformerSpec, QwenVLEncoderSpec, component_spec
    from sdtrt.stages.engine_set import engine_members
    from sdtrt.tools.compile import compile_model

    source = qwen[0]
    config = ExportConfig(precision="fp32", exporter="torchscript")
    text = ("text_encoder", "transformer")
    engine = compile_model(source, store, "onnxruntime", config, SimplifyConfig(check=False), components=text).final
    built = {c: ShapeProfile.from_json(a.manifest["profile"]).tokens for c, a in engine_members(engine).items()}
    assert built["transformer"] == (1, 256, 1024) and built["text_encoder"] == (35, 290, 1058)
    specs = {c: component_spec(source, c, "fp32") for c in TXT2IMG}
    transformer, llm = specs["transformer"], specs["text_encoder"]
    assert isinstance(transformer, QwenImageTransformerSpec) and isinstance(llm, QwenVLEncoderSpec)
    for spec in specs.values():
        spec.check_profile(shape_profile(spec, None, None, None))
    assert transformer.default_profile().tokens == Range(1, 256, 1024)
    assert llm.default_profile().tokens == llm.member_profile(transformer.default_profile()).tokens == (35, 290, 1058)
    with pytest.raises(ConfigError, match="QwenImagePipeline takes at most 1024 prompt tokens"):
        transformer.check_profile(ShapeProfile(tokens=Range(1, 256, 1025)))


def test_the_exporter_drops_exactly_the_parameters_the_spec_says_no_output_reads(qwen, store):
    """The one unread set check-blocks and the weight map read is what the exporter drops: every other parameter of
    the safetensors is in an initializer of the graph (found by value, a Linear's transposed), and none of the unread
    ones is. The module's transformer export (a cache hit); the slow block-parity test checks torch.export's."""
    from sdtrt.spec import component_spec
    from sdtrt.stages import export

    source = qwen[0]
    config = ExportConfig(precision="fp32", exporter="torchscript", component="transformer")
    stored = stored_parameters(source)
    unread = component_spec(source, "transformer", "fp32").unread_parameters(
        source.component_config("transformer"), stored
    )
    assert dropped_parameters(export.run(config, source, store).primary, stored) == unread
    assert {n.split(".", 2)[2] for n in unread} == {
        f"{m}.{p}" for m in ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2") for p in ("weight", "bias")
    }


def test_the_llm_streams_its_weights_under_the_names_transformers_loads_them():
    """Qwen2.5-VL's safetensors files keep the saved names (``visual.*``, ``model.layers.*``): the streamed export
    (``--weights stream``, the default for a bf16 or a 7B encoder) reads each weight from_pretrained loads, by
    transformers' own renaming, and its value is the loaded one. The whole streamed export runs under -m slow
    (tests/test_export_streamed.py)."""
    from sdtrt.graph.onnx_weights import read_tensor, safetensors_index
    from sdtrt.sources.models import load_folder, resolve_model
    from sdtrt.stages.export_stream import weight_free_network

    source = resolve_model("tiny-qwen-image")
    saved = safetensors_index(source.component_dir("text_encoder"))
    assert any(name.startswith("visual.") for name in saved) and "model.layers.0.mlp.up_proj.weight" in saved
    _, weights = weight_free_network(source, "text_encoder", torch.float32)
    loaded = load_folder(source, "text_encoder").state_dict()
    assert "model.language_model.layers.0.mlp.up_proj.weight" in loaded and set(loaded) <= set(weights["sources"])
    for name, tensor in loaded.items():
        assert np.array_equal(read_tensor(weights["sources"][name], np.dtype(np.float32)), tensor.numpy()), name


def test_guidance_runs_with_a_negative_prompt_alone_whatever_the_batch(qwen):
    """QwenImagePipeline guides (true_cfg_scale) only with a negative prompt: a request without one runs unguided in
    every batch (its key apart from guided ones), and guidance asked for without one is refused."""
    from sdtrt.pipeline.request import SizeRule

    rule = SizeRule.for_pipeline(qwen[2])
    plain = GenerateRequest(prompt="a fox", steps=2, height=128, width=128).sized_for(rule)
    guided = request(height=128, width=128).sized_for(rule)
    assert plain.guidance == 1.0 and guided.guidance == 4.0 and plain.batch_key != guided.batch_key
    with pytest.raises(RequestError, match=r"^guidance 4.0 was given without a negative prompt[^\n]+$"):
        request(negative_prompt=None).sized_for(rule)


def test_what_the_engines_cannot_do_is_refused(qwen):
    """Each in one line: a video (more frames than one) through the single-frame VAE engine, a layer of the LLM the
    engine does not keep, Qwen-Image-Edit's image inputs to the text encoder, and its transformer's conditioning
    before any export."""
    _, _, engine = qwen
    ids = torch.ones(1, 40, dtype=torch.int64)
    out = engine.text_encoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    assert out.hidden_states[-1].shape == (1, 40, 32)
    for call in (
        lambda: engine.vae.decode(torch.zeros(1, 4, 2, 16, 16)),
        lambda: out.hidden_states[1],
        lambda: engine.text_encoder(input_ids=ids, pixel_values=torch.zeros(4, 8), output_hidden_states=True),
    ):
        with pytest.raises(EngineInputError, match=r"^[^\n]+$"):
            call()
    from sdtrt.core.errors import ArtifactError
    from sdtrt.spec import QwenImageTransformerSpec

    edit = dict(qwen[0].component_config("transformer"), zero_cond_t=True)  # Qwen-Image-Edit-2511's conditioning
    with pytest.raises(ArtifactError, match=r"^this QwenImageTransformer2DModel sets zero_cond_t [^\n]+$"):
        QwenImageTransformerSpec.fields_from(edit, {}, 8)


@pytest.mark.parametrize("task", ["img2img", "inpaint"])
def test_an_edit_without_its_image_is_refused_before_running(qwen, task):
    """By generate before an engine runs (the edit pipeline made from the engine txt2img one), and by the check
    `sdtrt generate` makes before loading."""
    import diffusers

    from sdtrt.core.families import pipeline_class_name
    from sdtrt.pipeline.image_inputs import check_pipeline_inputs
    from sdtrt.pipeline.request import SizeRule

    source, _, txt2img = qwen
    edit = getattr(diffusers, pipeline_class_name("QwenImagePipeline", task)).from_pipe(txt2img)
    calls: list[int] = []
    hooks = [
        m.register_forward_pre_hook(lambda *_: calls.append(1))
        for m in (txt2img.text_encoder, txt2img.transformer, txt2img.vae)
    ]
    req = request(height=128, width=128)  # no image, no mask
    try:
        with pytest.raises(RequestError, match=r"^--task (img2img|inpaint) needs an input image: pass --image$"):
            generate(edit, req)
    finally:
        for hook in hooks:
            hook.remove()
    with pytest.raises(RequestError, match=r"--image"):
        check_pipeline_inputs(req, "QwenImagePipeline", task, SizeRule.for_model(source))
    assert not calls


@pytest.mark.slow
def test_the_default_compile_matches_pytorch(store):
    """``sdtrt compile``'s way: torch.export's exporter for the transformer, the VAE encoder too, the default checks
    and validation; txt2img at two more sizes, the VAE encoder engine, and img2img."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-qwen-image")
    profile = ShapeProfile(Range(1, 1, 2), Range(128, 128, 256), Range(128, 192, 256), False, Range(1, 256, 512))
    validation = ValidationConfig(steps=2)  # `sdtrt compile`'s: each member, then the images (one frame decoded)
    result = compile_model(
        source, store, "onnxruntime", ExportConfig(precision="fp32"), profile=profile, validation=validation
    )
    assert result.validation is not None and bool(result.validation)
    engine_set = result.final
    pipes = load_pipeline(source), load_pipeline(source, engine_set)
    assert_every_network_is_an_engine(pipes[1], reads_images=True)
    for height, width in [(128, 192), (256, 128)]:
        reference, engine = (
            generate(p, request(height=height, width=width), output_type="np").images[0] for p in pipes
        )
        psnr = psnr_db(engine, reference)
        print(f"tiny-qwen-image txt2img (default compile) {height}x{width}: PSNR {psnr:.1f} dB")
        assert psnr >= 35.0
    image = torch.rand(1, 3, 1, 128, 192) * 2 - 1  # one frame, as the img2img pipeline encodes it
    latents = [p.vae.encode(image).latent_dist.mean for p in pipes]
    assert latents[1].shape == (1, 4, 1, 16, 24) and torch.allclose(latents[1], latents[0], atol=1e-4)
    start = Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 192, 3), dtype=np.uint8))
    img2img = [load_pipeline(source, e, task="img2img") for e in (None, engine_set)]
    assert type(img2img[1]).__name__ == "QwenImageImg2ImgPipeline"
    assert_every_network_is_an_engine(img2img[1], reads_images=True)
    for height, width in [(128, 192), (128, 128)]:
        req = request(height=height, width=width, image=start, strength=0.6)
        reference, engine = (generate(p, req, output_type="np").images[0] for p in img2img)
        psnr = psnr_db(engine, reference)
        print(f"tiny-qwen-image img2img (default compile) {height}x{width}: PSNR {psnr:.1f} dB")
        assert reference.shape == (height, width, 3) and psnr >= 35.0


def test_fp16_builds_the_transformer_and_the_llm_in_bf16_where_the_target_has_it():
    """Qwen-Image's bf16 networks are never built fp16 by default: bf16 where the target runs it, else fp32 (ONNX
    Runtime on a CPU has no bf16); the VAE is fp32."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.spec import QwenImageTransformerSpec, QwenVLEncoderSpec
    from sdtrt.tools.compile import component_precision

    source = resolve_model("tiny-qwen-image")
    for component in ("transformer", "text_encoder", "vae_decoder"):
        assert component_precision(source, component, "fp16", "onnxruntime") == "fp32"
    assert component_precision(source, "transformer", "fp32", "onnxruntime") == "fp32"
    assert QwenImageTransformerSpec.fp16_fallback == QwenVLEncoderSpec.fp16_fallback == "bf16"


@pytest.mark.slow
def test_inpaint_matches_pytorch(store):
    """QwenImageInpaintPipeline on the engine set (the VAE encoder engine encodes the image and the masked image) at
    a square and a non-square size."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-qwen-image")
    profile = ShapeProfile(Range(1, 1, 2), Range(128, 128, 256), Range(128, 192, 256), False, Range(1, 160, 256))
    config = ExportConfig(precision="fp32", exporter="torchscript")
    engine_set = compile_model(source, store, "onnxruntime", config, SimplifyConfig(check=False), profile=profile).final
    pipes = [load_pipeline(source, e, task="inpaint") for e in (None, engine_set)]
    assert type(pipes[1]).__name__ == "QwenImageInpaintPipeline"
    assert_every_network_is_an_engine(pipes[1], reads_images=True)
    rng = np.random.default_rng(0)
    for height, width in [(128, 128), (256, 128)]:
        mask = np.zeros((height, width), dtype=np.uint8)
        mask[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
        start = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        req = request(height=height, width=width, image=start, mask_image=Image.fromarray(mask), strength=0.6)
        reference, engine = (generate(p, req, output_type="np").images[0] for p in pipes)
        psnr = psnr_db(engine, reference)
        print(f"tiny-qwen-image inpaint {height}x{width}: PSNR {psnr:.1f} dB")
        assert reference.shape == (height, width, 3) and reference.std() > 0.01 and psnr >= 35.0
