"""FLUX.2 [klein] on an engine set (issue 38): the Qwen3 LLM text encoder, the Flux2 transformer and AutoencoderKLFlux2
each an engine stand-in, images as the PyTorch fp32 Flux2KleinPipeline's (txt2img and with a reference image), and a
prompt over the LLM engine's tokens refused with one line before anything runs.

One fp32 ONNX Runtime engine set, shared by the module's tests; tiny sizes, two steps, true CFG (two passes a step).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
from sdtrt.standins.base import EngineModule
from sdtrt.standins.llm_encoder import EngineQwen3
from sdtrt.standins.transformer import EngineFlux2Transformer
from sdtrt.standins.vae_flux2 import EngineFlux2VAE
from sdtrt.tools.image_quality import psnr_db
from tests.helpers import centre_mask

SIZES = [(128, 128), (128, 192)]


@pytest.fixture(scope="module")
def klein(store):
    """The preset, and its (PyTorch fp32, engine) pipelines."""
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.compile import compile_model

    source = resolve_model("tiny-flux2-klein")
    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    return source, load_pipeline(source), load_pipeline(source, engine)


def request(**kwargs) -> GenerateRequest:
    return GenerateRequest(**({"prompt": "a red fox in the snow", "steps": 2, "seed": 3} | kwargs))


def images(pipes, req: GenerateRequest) -> list[np.ndarray]:
    return [generate(p, req, output_type="np").images[0] for p in pipes]


def test_every_network_is_an_engine_standin(klein):
    _, _, engine = klein
    networks = {name: m for name, m in engine.components.items() if isinstance(m, torch.nn.Module)}
    assert set(networks) == {"text_encoder", "transformer", "vae"}
    assert all(isinstance(m, EngineModule) for m in networks.values())
    assert isinstance(engine.text_encoder, EngineQwen3) and isinstance(engine.transformer, EngineFlux2Transformer)
    assert isinstance(engine.vae, EngineFlux2VAE) and engine.vae.encoder_runtime is not None
    reference = klein[1].vae.bn  # the latent statistics the pipeline applies, random in the preset
    assert torch.equal(engine.vae.bn.running_var, reference.running_var) and reference.running_var.std() > 0.1


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_txt2img_matches_pytorch(klein, size):
    check_txt2img(klein[1:], size, "tiny-flux2-klein")


def check_txt2img(pipes, size: tuple[int, int], preset: str) -> None:
    """The (PyTorch, engine) pipelines' images at ``size``: ≥ 35 dB apart, and an image (not a flat field)."""
    reference, engine = images(pipes, request(height=size[0], width=size[1]))
    psnr = psnr_db(engine, reference)
    print(f"{preset} txt2img {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    assert reference.shape == (*size, 3) and reference.std() > 0.01 and psnr >= 35.0


def noise_image(height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_reference_image_matches_pytorch(klein, size):
    """Klein's editing task: a reference image, encoded by the VAE encoder engine, joins the transformer's tokens."""
    check_reference_image(klein[1:], size, "tiny-flux2-klein")


def check_reference_image(pipes, size: tuple[int, int], preset: str) -> None:
    image = noise_image(128, 128)
    reference, engine = images(pipes, request(height=size[0], width=size[1], image=image))
    plain = generate(pipes[0], request(height=size[0], width=size[1]), output_type="np").images[0]
    psnr = psnr_db(engine, reference)
    print(f"{preset} reference image {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    # The engines agree, far closer than the reference image moves the image (random weights move it little).
    assert psnr >= 35.0 and psnr_db(plain, reference) < psnr - 40.0


def test_a_prompt_over_the_llm_engines_tokens_is_refused_before_running(klein):
    check_long_prompt_refused(klein[2])


def test_a_prompt_shorter_than_the_profiles_least_tokens_is_taken(klein):
    """Flux2KleinPipeline pads every prompt to max_sequence_length, so its engines never see a shorter one: a
    one-letter prompt (fewer tokens with its template than the profile's least) is no refusal."""
    from sdtrt.pipeline.token_limits import llm_kwargs

    engine = klein[2]
    least = engine.text_encoder.runtime.profile.tokens.min
    assert len(engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)) < least
    assert llm_kwargs(engine, ["x"]) == {"max_sequence_length": engine.text_encoder.runtime.profile.tokens.max}


def check_long_prompt_refused(engine) -> None:
    """A prompt over the engines' tokens: one line, before the LLM or the transformer runs."""
    calls = []
    for network in (engine.text_encoder, engine.transformer):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(RequestError, match="tokens with its chat template") as error:
        generate(engine, request(prompt="astronaut " * 600, height=128, width=128))
    assert "\n" not in str(error.value) and not calls


def test_what_the_llm_engine_cannot_do_is_refused(klein):
    _, _, engine = klein
    ids = torch.ones(2, 32, dtype=torch.int64)
    out = engine.text_encoder(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    assert out.hidden_states[9].shape == (2, 32, 32) and out.logits is None
    left_padded = torch.ones_like(ids)
    left_padded[1, :4] = 0
    for call in (
        lambda: out.hidden_states[3],  # a layer the engine was not built for
        lambda: engine.text_encoder(ids),  # no hidden states asked: a generation call
        lambda: engine.text_encoder.generate(ids),
        # Masks whose rows the graph masks otherwise than transformers: padded first, or all padding.
        lambda: engine.text_encoder(ids, attention_mask=left_padded, output_hidden_states=True),
        lambda: engine.text_encoder(ids, attention_mask=torch.zeros_like(ids), output_hidden_states=True),
    ):
        with pytest.raises(EngineInputError, match=r"^[^\n]+$"):
            call()


def test_the_transformer_profile_takes_the_largest_output_and_reference(klein):
    """The profile's reference count widens the patches: a 384² output (the profile's largest, 576 patches) with a
    384² reference (576 more) is inside the transformer engine's profile, as the VAE encoder's range takes it."""
    transformer, vae = klein[2].transformer, klein[2].vae
    spec, profile = transformer.runtime.spec, transformer.runtime.profile
    shapes = spec.input_shapes(1, 384, 384, 512)
    shapes = {name: tuple(2 * d if d == 576 else d for d in shape) for name, shape in shapes.items()}
    assert shapes[spec.input_names[0]] == (1, 1152, 16) and spec.check_shapes(shapes, profile) is None
    assert spec.check_shapes({**shapes, "img_ids": (1153, 4), spec.input_names[0]: (1, 1153, 16)}, profile)
    encoder = vae.encoder_runtime
    assert encoder.spec.check_shapes(encoder.spec.input_shapes(1, 384, 384), encoder.profile) is None


def test_reference_images_outside_the_profile_are_refused_before_running(klein):
    """Each refused in one line before an engine runs: a reference larger than the profile once the pipeline has
    resized it (it scales down only those over 1024²), and more references than the profile counts."""
    from sdtrt.cli.request_options import check_engine_size
    from sdtrt.core.artifact import Artifact
    from sdtrt.pipeline.image_inputs import check_pipeline_inputs
    from sdtrt.pipeline.request import SizeRule
    from sdtrt.stages.engine_set import engine_members, engine_profile

    source, _, engine = klein
    calls = []
    for network in (engine.text_encoder, engine.transformer, engine.vae):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    artifact = Artifact.open(engine.transformer.engine_paths["transformer"])  # a member: the set's profile
    cases = {"512×512 px (w×h) as the pipeline feeds it, its height outside": noise_image(512, 512),
             "2 reference image(s), more than the 1": [noise_image(128, 128)] * 2}  # fmt: skip
    for message, image in cases.items():
        req = request(height=128, width=128, image=image)
        rule = SizeRule.for_model(source)
        check_pipeline_inputs(req, "Flux2KleinPipeline", None, rule)  # sdtrt generate --image: klein takes references
        with pytest.raises(RequestError, match=re.escape(message)) as error:
            generate(engine, req)
        assert "\n" not in str(error.value)
        with pytest.raises(RequestError, match=re.escape(message)):  # the CLI's check, before loading
            check_engine_size(engine_profile(engine_members(artifact)), req, rule)
    assert not calls


def test_first_block_cache_is_refused_for_flux2_before_any_export(klein):
    """diffusers' First-Block Cache fails on the PyTorch FLUX.2 transformer: no reference, refused; TaylorSeer and
    MagCache take the split (tests/test_step_cache_flux2.py runs them)."""
    from sdtrt.core.config import TRANSFORMER_PARTS
    from sdtrt.core.errors import ConfigError
    from sdtrt.tools.compile import cache_members

    with pytest.raises(ConfigError, match=r"First-Block Cache fails on the PyTorch [^\n]+issue 14280"):
        cache_members(klein[0], ("first-block",))
    assert cache_members(klein[0], ("taylorseer", "magcache")) == TRANSFORMER_PARTS


def test_fp16_builds_the_llm_in_bf16_where_the_target_runs_it(klein):
    from sdtrt.spec import LLMEncoderSpec
    from sdtrt.stages.export import precision_note
    from sdtrt.tools.compile import component_precision

    source = klein[0]
    assert component_precision(source, "text_encoder", "fp16", "tensorrt-rtx") == "bf16"
    assert component_precision(source, "text_encoder", "fp16", "onnxruntime") == "fp32"  # no bf16 kernels there
    assert component_precision(source, "transformer", "fp16", "onnxruntime") == "fp16"
    note = precision_note(LLMEncoderSpec.for_model(source, precision="bf16"))
    assert note["graph"] == "bf16" and "overflow fp16" in note["why"]


@pytest.mark.slow
def test_llm_engine_exported_by_torch_export_matches(klein, store):
    """The LLM encoder as torch.export's exporter gives it (auto's for one too large to load whole, streamed): the
    prompt embedding as the PyTorch pipeline stacks it, at two token counts, padding and all."""
    from sdtrt.tools.compile import compile_model

    source, reference, _ = klein
    config = ExportConfig(precision="fp32", exporter="dynamo", component="text_encoder")
    member = compile_model(source, store, "onnxruntime", config, components=("text_encoder",)).final
    engine = load_pipeline(source, member)
    assert isinstance(engine.text_encoder, EngineQwen3)
    for tokens in (64, 100):
        want, got = (
            p._get_qwen3_prompt_embeds(p.text_encoder, p.tokenizer, ["a red fox", "snow"], max_sequence_length=tokens)
            for p in (reference, engine)
        )
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)


def test_the_cli_refuses_a_long_prompt_before_loading(klein):
    from .helpers import run_cli

    result = run_cli("generate", "--model", "tiny-flux2-klein", "--prompt", "astronaut " * 600)
    assert result.returncode != 0 and "Loading pipeline" not in result.stderr
    assert "tokens with its chat template, more than the 512 the pipeline takes; shorten it" in result.stderr


def test_triton_serves_a_reference_image_row_and_refuses_one_outside_the_profile(klein, inpaint, store, tmp_path):
    """On the Triton wire a row's `image` is klein's reference (the Triton model's execute on numpy rows): generate's
    image for it; one the profile cannot take gets its one line, the other rows their images; a row with a mask too
    is inpainted (Flux2KleinInpaintPipeline), generate's image for it."""
    from sdtrt.tools.compile import compile_model

    from . import triton_backend

    source, _, engine = klein
    built = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final  # the fixture's: a hit
    numbers = {"steps": 2, "seed": 3, "height": 128, "width": 128}
    repainted = {"image": noise_image(128, 128), "mask_image": centre_mask(128, 128)}
    with triton_backend.served(built, tmp_path) as served:
        edited, too_big, inpainted = served.execute([
            triton_backend.row("a red fox in the snow", **numbers, image=noise_image(128, 128)),
            triton_backend.row("a red fox in the snow", **numbers, image=noise_image(512, 512)),
            triton_backend.row("a red fox in the snow", **numbers, **repainted),
        ])  # fmt: skip
    local = generate(engine, request(height=128, width=128, image=noise_image(128, 128))).images[0]
    np.testing.assert_array_equal(edited.image()[0], np.asarray(local))
    local = generate(inpaint[1], inpaint_request(128, 128)).images[0]
    np.testing.assert_array_equal(inpainted.image()[0], np.asarray(local))
    assert too_big.error.code() == "INVALID_ARG" and "\n" not in too_big.error.message()
    assert "512×512 px (w×h) as the pipeline feeds it, its height outside" in too_big.error.message()


def inpaint_request(height: int, width: int, **kwargs) -> GenerateRequest:
    given = {"image": noise_image(height, width), "mask_image": centre_mask(height, width)}
    return request(height=height, width=width, **given, **kwargs)


@pytest.fixture(scope="module")
def inpaint(klein):
    """(PyTorch, engine) Flux2KleinInpaintPipeline over the txt2img pipelines' components (`--task inpaint`)."""
    from sdtrt.pipeline.loading import task_pipelines

    return tuple(task_pipelines(pipe, {"inpaint": "Flux2KleinInpaintPipeline"})["inpaint"] for pipe in klein[1:])


@pytest.mark.parametrize(
    "size", [SIZES[0], pytest.param(SIZES[1], marks=pytest.mark.slow)], ids=["square", "non-square"]
)
def test_inpaint_matches_pytorch(inpaint, size):
    """Flux2KleinInpaintPipeline: the image to repaint, encoded by the VAE encoder engine, is both the start and a
    reference whose tokens follow the generated ones in the transformer engine's sequence."""
    from .helpers import assert_every_network_is_an_engine

    assert type(inpaint[1]).__name__ == "Flux2KleinInpaintPipeline"
    networks = assert_every_network_is_an_engine(inpaint[1], reads_images=True)
    assert set(networks) == {"text_encoder", "transformer", "vae"}
    fed = []
    hook = inpaint[1].transformer.register_forward_pre_hook(
        lambda _, args, kwargs: fed.append(kwargs["hidden_states"].shape[1]), with_kwargs=True
    )
    try:
        reference, engine = images(inpaint, inpaint_request(*size))
    finally:
        hook.remove()
    psnr = psnr_db(engine, reference)
    print(f"tiny-flux2-klein inpaint {size[0]}x{size[1]}: PSNR {psnr:.1f} dB")
    assert reference.shape == (*size, 3) and reference.std() > 0.01 and psnr >= 35.0
    assert fed and set(fed) == {2 * (size[0] // 16) * (size[1] // 16)}  # the generated patches and the image's


def test_inpaint_inputs_it_cannot_take_are_refused_before_running(inpaint):
    """Without a mask, and with an image_reference beyond the profile's one reference (the image to repaint is
    the first): each one line before an engine runs."""
    engine = inpaint[1]
    calls = []
    for network in (engine.text_encoder, engine.transformer, engine.vae):
        network.register_forward_pre_hook(lambda *_: calls.append(1))
    cases = {
        "needs a mask image": dataclasses.replace(inpaint_request(128, 128), mask_image=None),
        "2 reference image(s), more than the 1": inpaint_request(128, 128, image_reference=noise_image(128, 128)),
    }
    for message, req in cases.items():
        with pytest.raises(RequestError, match=re.escape(message)) as error:
            generate(engine, req)
        assert "\n" not in str(error.value)
    assert not calls


@pytest.mark.slow  # a forked CLI run loading the set: ~14 s
def test_the_cli_inpaints_as_the_library_does(klein, inpaint, store, tmp_path):
    """`sdtrt generate --task inpaint --image --mask` on the set: the library's engine image, pixel for pixel."""
    from sdtrt.tools.compile import compile_model

    from .helpers import last_line, run_cli

    built = compile_model(klein[0], store, "onnxruntime", ExportConfig(precision="fp32")).final  # the fixture's: a hit
    noise_image(128, 192).save(tmp_path / "photo.png")
    centre_mask(128, 192).save(tmp_path / "mask.png")
    out = tmp_path / "out.png"
    result = run_cli(
        "generate", "--engine", str(built.path), "--task", "inpaint", "--image", str(tmp_path / "photo.png"),
        "--mask", str(tmp_path / "mask.png"), "--prompt", "a red fox in the snow", "--steps", "2", "--seed", "3",
        "--out", str(out), check=True,
    )  # fmt: skip
    assert last_line(result.stdout) == str(out)
    local = generate(inpaint[1], inpaint_request(128, 192)).images[0]
    np.testing.assert_array_equal(np.asarray(Image.open(out)), np.asarray(local))
