"""The transformer generation (issue 20): SD3 / SD3.5 and Flux.1 dev / schnell on tiny presets.

Presets build offline and load as their diffusers pipelines; families come from the configs; every
network's spec matches its exported graph; ONNX Runtime matches PyTorch fp32 per component.
"""

from __future__ import annotations

import json

import pytest
import torch

from sdtrt.sources.models import resolve_model

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

    from sdtrt.sources.presets import PRESETS

    class_name, kwargs = PRESETS["sd35-medium-random"].denoiser
    with init_empty_weights():
        transformer = getattr(diffusers, class_name)(**kwargs)
    parameters = sum(p.numel() for p in transformer.parameters())
    state = sum(t.numel() for t in transformer.state_dict().values())
    assert round(parameters / 1e9, 2) == 2.24 and round(state / 1e9, 2) == 2.47
    assert transformer.config.dual_attention_layers == tuple(range(13)) and transformer.config.qk_norm == "rms_norm"


@pytest.mark.parametrize(
    ("preset", "family", "pipelines"),
    [("tiny-sd3", "sd3", ("StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")),
     ("tiny-flux", "flux", ("FluxImg2ImgPipeline", "FluxInpaintPipeline")),
     ("tiny-flux-schnell", "flux-schnell", ("FluxImg2ImgPipeline", "FluxInpaintPipeline"))],
)  # fmt: skip
def test_families_come_from_the_transformer_config(preset, family, pipelines):
    from sdtrt.core.families import pipeline_class_name
    from sdtrt.spec import denoiser_component

    model = resolve_model(preset)
    assert model.family() == family and model.denoiser_folder == "transformer"
    assert denoiser_component(model) == "transformer"
    index_class = model.pipeline_class()
    assert tuple(pipeline_class_name(index_class, task) for task in ("img2img", "inpaint")) == pipelines


def test_unsupported_transformers_are_still_refused_in_one_line(tmp_path):
    import shutil

    from sdtrt.core.errors import UnsupportedModelError

    folder = tmp_path / "pixart"
    shutil.copytree(resolve_model("tiny-flux").path, folder)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"_class_name": "PixArtTransformer2DModel"}))
    with pytest.raises(UnsupportedModelError, match=r"is a PixArtTransformer2DModel; sdtrt supports .* Flux\.1"):
        resolve_model(str(folder))


# Each preset's fp32 ONNX Runtime engine set over every network (SD3: transformer, CLIP-L, CLIP-G, T5, VAE
# decoder and encoder), compared with PyTorch fp32 on each spec's cases. Built into the session store: the
# pipeline, LoRA and serving tests use the same sets.
COMPILED = ("tiny-sd3", "tiny-flux", "tiny-flux-schnell")


@pytest.fixture(scope="module", params=COMPILED)
def compiled(request, store):
    from sdtrt.core.config import ExportConfig, ValidationConfig
    from sdtrt.tools.compile import compile_model

    model = resolve_model(request.param)
    result = compile_model(
        model, store, target="onnxruntime", export_config=ExportConfig(precision="fp32"),
        validation=ValidationConfig(images=False),
    )  # fmt: skip
    return model, result


def test_every_network_matches_pytorch_on_onnx_runtime(compiled):
    from sdtrt.spec import model_components

    model, result = compiled
    report = result.validation
    assert report, report.failures
    compared = {row["case"].split()[0] for row in report.tensors}  # a set's rows name their member
    assert compared == set(model_components(model))


def test_graph_io_is_the_spec_and_t5_is_fp32_with_its_reason(compiled):
    from sdtrt.graph.onnx_graph import graph_io
    from sdtrt.spec import spec_from_json

    model, result = compiled
    exports = [a for a in result.artifacts if a.stage == "export"]
    for exported in exports:
        spec = spec_from_json(exported.manifest["io"])
        inputs, outputs = graph_io(exported.primary)
        assert [(t.name, t.dtype) for t in inputs + outputs] == [
            (t.name, t.dtype) for t in spec.inputs() + spec.outputs()
        ]
        if spec.architecture:  # the transformers' and T5's named axes (CLIP's fp32 TorchScript graph names its own)
            assert [t.shape for t in inputs + outputs] == [t.shape for t in spec.inputs() + spec.outputs()]
        if spec.architecture == "T5EncoderModel":
            assert exported.manifest["precision"]["graph"] == "fp32"
    # Asked for fp16, compile still builds T5 in fp32, deciding by the folder's class (text_encoder_2 in Flux).
    from sdtrt.spec import FOLDERS, model_components
    from sdtrt.tools.compile import component_precision

    for component in model_components(model):
        t5 = model.component_class(FOLDERS[component])[1] == "T5EncoderModel"
        expected = "fp32" if t5 or component.startswith("vae") else "fp16"
        assert component_precision(model, component, "fp16") == expected, component


def test_flux_sizes_off_the_16_pixel_grid_are_refused_in_one_line():
    from sdtrt.core.errors import RequestError
    from sdtrt.pipeline.request import SizeRule

    rule = SizeRule.for_model(resolve_model("tiny-flux"))
    assert rule.multiple == 16 and rule.resolve(256, 384) == (256, 384)
    with pytest.raises(RequestError, match="width 264 is not a positive multiple of 16 pixels"):
        rule.resolve(256, 264)


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux"])
def test_more_t5_tokens_than_the_profile_are_refused(preset):
    from sdtrt.spec import component_spec, denoiser_spec

    model = resolve_model(preset)
    spec = denoiser_spec(model, "fp32")
    profile = spec.default_profile()
    too_many = profile.tokens.max + 1
    assert "T5 tokens are outside the engine's profile" in profile.tokens_problem(too_many)
    for checked in (spec, component_spec(model, "text_encoder_3" if preset == "tiny-sd3" else "text_encoder_2")):
        fits = checked.input_shapes(1, 256, 256, tokens=profile.tokens.max)
        assert checked.check_shapes(fits, profile) is None
        problem = checked.check_shapes(checked.input_shapes(1, 256, 256, tokens=too_many), profile)
        assert problem is not None and "outside the engine's profile" in problem


@pytest.mark.slow
@pytest.mark.timeout(3600)  # measured alone: preset + export + simplify + ORT build ~15 min, the parity run more
def test_sd35_medium_transformer_export_simplify_and_parity_at_1024():
    """SD3.5 Medium's 2.5 B-parameter transformer (random weights), fp16 graph, batch 2 at 1024²: exported with
    torch.export, simplified, and compared with PyTorch fp32 on ONNX Runtime. The fp32 network (10 GB) is freed
    before the engine runs: both at once took 21 GB here, and the machine paged its weights in and out."""
    import gc

    from sdtrt.core.config import ExportConfig, OrtBuildConfig, ShapeProfile, SimplifyConfig
    from sdtrt.core.config import Range as R
    from sdtrt.core.store import Store
    from sdtrt.runtime import open_runtime
    from sdtrt.runtime.compare import tensor_stats
    from sdtrt.sources.models import load_folder
    from sdtrt.spec import ValidationCase, denoiser_spec
    from sdtrt.stages import build_ort, export, simplify
    from sdtrt.stages.graph_module import graph_module

    model = resolve_model("sd35-medium-random")
    assert model.family() == "sd3"
    store = Store(model.path.parent / "engines-slow")
    exported = export.run(ExportConfig(component="transformer", precision="fp16"), model, store)
    simplified = simplify.run(SimplifyConfig(), exported, store)
    profile = ShapeProfile(R(1, 1, 1), R(1024, 1024, 1024), R(1024, 1024, 1024), tokens=R(256, 256, 256))
    built = build_ort.run(OrtBuildConfig(profile=profile), simplified, store)
    spec = denoiser_spec(model)
    feeds = spec.case_inputs(ValidationCase(2, 1024, 1024, timestep=500.0))
    network = load_folder(model, "transformer", torch.float32)
    with torch.no_grad():
        expected = graph_module(spec, network)(*(feeds[name] for name in spec.input_names))
    del network
    gc.collect()
    runtime = open_runtime(built, model)
    got = runtime.run(feeds)[spec.output_names[0]]
    runtime.close()
    row = tensor_stats(got, expected)
    print(f"\nsd35-medium-random transformer, fp16 graph vs PyTorch fp32 at 1024², batch 2: {row}")
    assert row["finite"] and row["cosine"] > 0.999, row


def test_the_t5_token_range_is_a_compile_option():
    """--tokens sets the profile's T5 range (what a too-long prompt's message says to rebuild with); refused, before
    any work, for a model without T5 or a range out of order."""
    from sdtrt.cli.build_options import shape_profile
    from sdtrt.core.config import Range
    from sdtrt.core.errors import RequestError
    from sdtrt.spec import denoiser_spec

    from .helpers import last_line, run_cli

    spec = denoiser_spec(resolve_model("tiny-flux"), "fp32")
    assert shape_profile(spec, None, None, None, "16:64:128").tokens == Range(16, 64, 128)
    with pytest.raises(RequestError, match="tokens range 128:64:16 must satisfy"):
        shape_profile(spec, None, None, None, "128:64:16")
    result = run_cli("compile", "--model", "tiny", "--tokens", "32:64:128")
    assert result.returncode == 2 and "this model has no T5" in last_line(result.stderr)


def test_cache_ls_calls_a_sets_validation_report_a_set(compiled, store):
    """A validation report of an engine set was listed under the set's first member (text_encoder)."""
    from .helpers import run_cli

    _, result = compiled
    reports = [
        a for a in store.artifacts()
        if a.stage == "validate" and a.manifest["inputs"][0].get("path") == str(result.final.path)
    ]  # fmt: skip
    assert reports
    listed = run_cli("cache", "ls", "--engines", str(store.root), check=True).stdout.splitlines()
    row = next(line.split() for line in listed if line.endswith(str(reports[0].path)))
    assert row[0] == "validate" and row[2] == "set", row


@pytest.mark.parametrize(("preset", "takes"), [("tiny", True), ("tiny-flux", True), ("tiny-flux-schnell", False)])
def test_validate_and_bench_run_with_the_models_own_guidance(preset, takes):
    """Their configs left guidance at 7.5, so Flux dev was validated and timed at 7.5, not its 3.5: none configured,
    none is passed, and each pipeline runs with its own __call__ default (test_flux_tasks holds those)."""
    from sdtrt.core.config import BenchConfig, ValidationConfig
    from sdtrt.pipeline.request import SizeRule

    rule = SizeRule.for_model(resolve_model(preset))
    assert rule.applicable(ValidationConfig().guidance) is rule.applicable(BenchConfig().guidance) is None
    assert rule.applicable(5.0) == (5.0 if takes else None)
