"""FLUX.2 [dev] on an engine set (issue 38): the Mistral3 LLM text encoder, the Flux2 transformer (guidance
embedded) and AutoencoderKLFlux2 each an engine stand-in, images as the PyTorch fp32 Flux2Pipeline's (txt2img and
with a reference image), and a prompt over the LLM engine's tokens refused with one line before anything runs.

The engine-set tests share one fp32 ONNX Runtime engine set (about a minute to build here: the 30-layer LLM and
the transformer's export), so they are slow tests; the default suite checks what needs no engine: the prompt count
as the pipeline tokenizes it, the CLI's refusal before loading, and the precision each member gets.
"""

from __future__ import annotations

import pytest
import torch

from sdtrt.core.config import ExportConfig
from sdtrt.core.errors import EngineInputError, RequestError
from sdtrt.pipeline.loading import load_pipeline
from sdtrt.standins.base import EngineModule
from sdtrt.standins.llm_encoder import EngineMistral3
from sdtrt.standins.transformer import EngineFlux2Transformer
from sdtrt.standins.vae_flux2 import EngineFlux2VAE

from .test_flux2_klein import check_long_prompt_refused, check_reference_image, check_txt2img  # klein's checks

SIZES = [(128, 128), (128, 192)]


@pytest.fixture(scope="module")
def source():
    from sdtrt.sources.models import resolve_model

    return resolve_model("tiny-flux2")


@pytest.fixture(scope="module")
def dev(store, source):
    """The preset, and its (PyTorch fp32, engine) pipelines."""
    from sdtrt.tools.compile import compile_model

    engine = compile_model(source, store, "onnxruntime", ExportConfig(precision="fp32")).final
    return source, load_pipeline(source), load_pipeline(source, engine)


@pytest.mark.slow
def test_every_network_is_an_engine_standin(dev):
    _, reference, engine = dev
    networks = {name: m for name, m in engine.components.items() if isinstance(m, torch.nn.Module)}
    assert set(networks) == {"text_encoder", "transformer", "vae"}
    assert all(isinstance(m, EngineModule) for m in networks.values())
    assert isinstance(engine.text_encoder, EngineMistral3) and isinstance(engine.transformer, EngineFlux2Transformer)
    assert isinstance(engine.vae, EngineFlux2VAE) and engine.vae.encoder_runtime is not None
    assert engine.text_encoder.spec.hidden_layers == (10, 20, 30) and reference.transformer.config.guidance_embeds


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_txt2img_matches_pytorch(dev, size):
    check_txt2img(dev[1:], size, "tiny-flux2")


@pytest.mark.slow
@pytest.mark.parametrize("size", SIZES, ids=["square", "non-square"])
def test_reference_image_matches_pytorch(dev, size):
    """The editing task: a reference image, encoded by the VAE encoder engine, joins the transformer's tokens."""
    check_reference_image(dev[1:], size, "tiny-flux2")


@pytest.mark.slow
def test_a_prompt_over_the_llm_engines_tokens_is_refused_before_running(dev):
    check_long_prompt_refused(dev[2])


@pytest.mark.slow
def test_the_vision_path_and_generation_are_refused(dev):
    """Only Flux2Pipeline's prompt upsampling reaches the vision tower, through generate: refused in one line."""
    _, _, engine = dev
    ids = torch.ones(1, 32, dtype=torch.int64)
    out = engine.text_encoder(ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    assert out.hidden_states[30].shape == (1, 32, 32)
    for call in (
        lambda: engine.text_encoder.generate(ids),
        lambda: engine.text_encoder(ids, pixel_values=torch.zeros(1, 3, 16, 16), output_hidden_states=True),
    ):
        with pytest.raises(EngineInputError, match=r"^[^\n]+$"):
            call()


def test_the_prompt_count_is_what_the_pipeline_tokenizes(source):
    """The check counts each prompt with Flux2Pipeline's system message, as the pipeline's chat has it (the
    template's markup and all), from the tokenizer folder alone as the CLI does before loading."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from transformers import AutoTokenizer

    from sdtrt.core.families import llm_system_message
    from sdtrt.pipeline.request import check_llm_prompts

    tokenizer = AutoTokenizer.from_pretrained(source.path / "tokenizer", local_files_only=True)
    prompt = "a red fox in the snow"
    ids = tokenizer.apply_chat_template(format_input([prompt]), tokenize=True, return_dict=True)["input_ids"][0]
    system = llm_system_message("Flux2Pipeline")
    check_llm_prompts([prompt], tokenizer, len(ids), built=True, system=system)  # exactly at the limit: taken
    with pytest.raises(
        RequestError, match=rf"is {len(ids)} tokens with its chat template, more than the {len(ids) - 1}"
    ):
        check_llm_prompts([prompt], tokenizer, len(ids) - 1, built=True, system=system)
    assert llm_system_message("Flux2KleinPipeline") is None


def test_the_cli_refuses_a_long_prompt_before_loading(source):
    from .helpers import run_cli

    result = run_cli("generate", "--model", "tiny-flux2", "--prompt", "astronaut " * 600)
    assert result.returncode != 0 and "Loading pipeline" not in result.stderr
    assert "tokens with its chat template, more than the 512 the pipeline takes; shorten it" in result.stderr


def test_fp16_builds_the_mistral_encoder_in_bf16_where_the_target_runs_it(source):
    """Mistral-Small-3.x ships in bf16; on the tiny model fp16 embeddings gave images at 115–118 dB of fp32's and
    bf16 at 93–95 dB (notes), which says nothing of the real model's activations."""
    from sdtrt.spec import MistralEncoderSpec, component_spec
    from sdtrt.tools.compile import component_precision

    assert component_precision(source, "text_encoder", "fp16", "tensorrt-rtx") == "bf16"
    assert component_precision(source, "text_encoder", "fp16", "onnxruntime") == "fp32"  # no bf16 kernels there
    spec = component_spec(source, "text_encoder", precision="fp32")
    assert isinstance(spec, MistralEncoderSpec) and spec.hidden_layers == (10, 20, 30) and spec.hidden_size == 32
