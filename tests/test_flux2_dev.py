"""FLUX.2 [dev] on an engine set (issue 38): the Mistral3 LLM text encoder, the Flux2 transformer (guidance
embedded) and AutoencoderKLFlux2 each an engine stand-in, images as the PyTorch fp32 Flux2Pipeline's (txt2img and
with a reference image), and a prompt over the LLM engine's tokens refused with one line before anything runs.

The engine-set tests share one fp32 ONNX Runtime engine set (about a minute to build here: the 31-layer LLM and
the transformer's export), so they are slow tests; the default suite checks what needs no engine: the prompt count
as the pipeline tokenizes it, the check before loading, and the precision each member gets.
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


@pytest.mark.slow
def test_left_padded_prompts_match_pytorch(dev):
    """Mistral's tokenizers pad on the left (the preset's too): the engine's layers on a left-padded batch of two
    prompts are transformers' own, pad rows included."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input

    _, reference, engine = dev
    messages = format_input(["a red fox", "a red fox in the snow at dawn"], reference.system_message)
    inputs = reference.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt", padding="max_length", max_length=192
    )  # fmt: skip
    assert (inputs["attention_mask"][:, 0] == 0).all()  # both rows start with padding
    got, want = (
        pipe.text_encoder(**inputs, output_hidden_states=True, use_cache=False).hidden_states
        for pipe in (engine, reference)
    )  # fmt: skip
    for layer in engine.text_encoder.spec.hidden_layers:
        torch.testing.assert_close(got[layer], want[layer], atol=1e-4, rtol=1e-4)


def processor(tokenizer):
    """A text-and-image processor as FLUX.2 [dev]'s tokenizer folder loads (PixtralProcessor, which needs
    torchvision, absent here): Pixtral's image processor and the preset's tokenizer; its first argument is images."""
    from transformers import PixtralImageProcessorPil, ProcessorMixin

    class PixtralLikeProcessor(ProcessorMixin):
        def __init__(self, image_processor, tokenizer, chat_template=None):
            super().__init__(image_processor, tokenizer, chat_template=chat_template)

    return PixtralLikeProcessor(PixtralImageProcessorPil(), tokenizer, chat_template=tokenizer.chat_template)


def test_the_prompt_count_is_what_the_pipeline_tokenizes(source):
    """The check counts each prompt with Flux2Pipeline's system message, as the pipeline's chat has it (the
    template's markup and all, its BOS once though the tokenizer adds one), from the tokenizer folder alone as the
    CLI does before loading, or through the processor the pipeline holds."""
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from transformers import AutoTokenizer

    from sdtrt.core.families import llm_system_message
    from sdtrt.pipeline.token_limits import check_llm_prompts

    tokenizer = AutoTokenizer.from_pretrained(source.path / "tokenizer", local_files_only=True)
    assert tokenizer.padding_side == "left" and tokenizer("a").input_ids[0] == tokenizer.bos_token_id  # as Mistral's
    prompt = "a red fox in the snow"
    system = llm_system_message("Flux2Pipeline")
    ids = tokenizer.apply_chat_template(format_input([prompt], system), tokenize=True, return_dict=True)["input_ids"]
    for counter in (tokenizer, processor(tokenizer)):
        check_llm_prompts([prompt], counter, len(ids[0]), built=True, system=system)  # exactly at the limit: taken
        with pytest.raises(
            RequestError, match=rf"is {len(ids[0])} tokens with its chat template, more than the {len(ids[0]) - 1}"
        ):
            check_llm_prompts([prompt], counter, len(ids[0]) - 1, built=True, system=system)
    assert llm_system_message("Flux2KleinPipeline") is None


def test_the_check_before_loading_counts_the_system_message(source):
    """The CLI's check (before the pipeline loads) on a prompt that fits the pipeline's 512 tokens alone and not
    after Flux2Pipeline's system message: refused."""
    from transformers import AutoTokenizer

    from sdtrt.pipeline.request import GenerateRequest, check_prompt_tokens
    from sdtrt.pipeline.token_limits import check_llm_prompts

    tokenizer = AutoTokenizer.from_pretrained(source.path / "tokenizer", local_files_only=True)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=True, return_dict=True)
    alone = len(chat["input_ids"])
    prompt = "a" + " a" * (512 - alone)  # " a" is one token: 512 with the template alone
    check_llm_prompts([prompt], tokenizer, 512, built=False)
    with pytest.raises(RequestError, match=r"tokens with its chat template, more than the 512 the pipeline takes"):
        check_prompt_tokens(source, GenerateRequest(prompt=prompt), None)


def test_fp16_builds_the_mistral_encoder_in_bf16_where_the_target_runs_it(source):
    """Mistral-Small-3.x ships in bf16; on the tiny model fp16 embeddings gave images at 115–118 dB of fp32's and
    bf16 at 93–95 dB (notes), which says nothing of the real model's activations."""
    from sdtrt.spec import MistralEncoderSpec, component_spec
    from sdtrt.tools.compile import component_precision

    assert component_precision(source, "text_encoder", "fp16", "tensorrt-rtx") == "bf16"
    assert component_precision(source, "text_encoder", "fp16", "onnxruntime") == "fp32"  # no bf16 kernels there
    spec = component_spec(source, "text_encoder", precision="fp32")
    assert isinstance(spec, MistralEncoderSpec) and spec.hidden_layers == (10, 20, 30) and spec.hidden_size == 32


def test_the_engine_takes_rows_padded_on_the_tokenizers_side():
    """Mistral's tokenizers pad on the left, Qwen's on the right; a row of no token, or two runs, is refused."""
    from sdtrt.standins.llm_encoder import one_run_of_tokens

    right, left = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert one_run_of_tokens(right, left=False) and one_run_of_tokens(right, left=True)
    assert one_run_of_tokens(left, left=True) and not one_run_of_tokens(left, left=False)
    for refused in ([[0, 0, 0, 0]], [[0, 1, 1, 0]], [[1, 0, 1, 1]]):
        assert not one_run_of_tokens(torch.tensor(refused), left=True)


def test_a_sliding_window_shorter_than_the_prompt_is_refused(source):
    """MistralModel windows only a mask it builds itself; the graph hands it a prepared one, so it would not."""
    from sdtrt.core.errors import UnsupportedModelError
    from sdtrt.spec import MistralEncoderSpec

    class Windowed:
        def __getattr__(self, name):
            return getattr(source, name)

        def component_config(self, folder):
            config = source.component_config(folder)
            return config | {"text_config": config["text_config"] | {"sliding_window": 64}}

    with pytest.raises(UnsupportedModelError, match=r"^[^\n]*sliding window of 64 tokens, fewer than the 512"):
        MistralEncoderSpec.for_model(Windowed())
