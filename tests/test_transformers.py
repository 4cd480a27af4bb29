"""The transformer generation (issue 20): SD3 / SD3.5 and Flux.1 dev / schnell on tiny presets.

Presets build offline and load as their diffusers pipelines; families come from the configs; every
network's spec matches its exported graph; ONNX Runtime matches PyTorch fp32 per component.
"""

from __future__ import annotations

import json

import pytest
import torch

from sdtrt.models import resolve_model

TRANSFORMER_PRESETS = ("tiny-sd3", "tiny-flux", "tiny-flux-schnell")


@pytest.fixture(scope="module", params=TRANSFORMER_PRESETS)
def source(request):
    return resolve_model(request.param)


def test_presets_load_as_their_pipelines_and_generate(source):
    import diffusers

    index = json.loads((source.path / "model_index.json").read_text())
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(source.path, local_files_only=True)
    vae = pipe.vae.config
    sd3 = source.name == "tiny-sd3"
    # SD3's and Flux's 16-channel VAEs, with the shift and scale their configs have.
    assert vae.latent_channels == 16 and (vae.shift_factor, vae.scaling_factor) == (
        (0.0609, 1.5305) if sd3 else (0.1159, 0.3611)
    )
    t5 = pipe.text_encoder_3 if sd3 else pipe.text_encoder_2
    assert type(t5).__name__ == "T5EncoderModel" and type(pipe.tokenizer_3 if sd3 else pipe.tokenizer_2).__name__ in (
        "T5Tokenizer",
        "T5TokenizerFast",
    )
    if not sd3:
        assert pipe.transformer.config.guidance_embeds == (source.name == "tiny-flux")
    prompt = "a photograph of an astronaut riding a horse " * 12  # over 77 tokens: T5 takes it whole
    extra = {"negative_prompt": "blurry"} if sd3 else {}
    image = pipe(
        prompt, num_inference_steps=2, height=256, width=256, output_type="np", max_sequence_length=128,
        generator=torch.Generator().manual_seed(0), **extra,
    ).images  # fmt: skip
    assert image.shape == (1, 256, 256, 3) and image.std() > 0.01


def test_t5_tokenizer_is_made_offline_and_covers_text(source):
    from transformers import T5TokenizerFast

    folder = source.path / ("tokenizer_3" if source.name == "tiny-sd3" else "tokenizer_2")
    tokenizer = T5TokenizerFast.from_pretrained(folder)
    ids = tokenizer("A photo of the astronaut, 42!").input_ids
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.unk_token_id not in ids and len(ids) > 10


def test_sd35_medium_preset_has_the_real_parameter_count():
    """SD3.5 Medium's transformer: 2.24 B parameters + the 384² × 1536 positional buffer, as its 4.94 GB bf16 file."""
    import diffusers
    from accelerate import init_empty_weights

    from sdtrt.presets import PRESETS

    class_name, kwargs = PRESETS["sd35-medium-random"].denoiser
    with init_empty_weights():
        transformer = getattr(diffusers, class_name)(**kwargs)
    parameters = sum(p.numel() for p in transformer.parameters())
    state = sum(t.numel() for t in transformer.state_dict().values())
    assert round(parameters / 1e9, 2) == 2.24 and round(state / 1e9, 2) == 2.47
    assert transformer.config.dual_attention_layers == tuple(range(13)) and transformer.config.qk_norm == "rms_norm"
