"""Every network of the pipeline as a graph: specs, export, simplify and ONNX Runtime parity with PyTorch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import ExportConfig, OrtBuildConfig, SimplifyConfig
from sdtrt.core.errors import ArtifactError, ConfigError, EngineInputError, ModelNotFoundError, RequestError
from sdtrt.graph.onnx_graph import artifact_spec
from sdtrt.runtime import open_runtime
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import TextEncoderSpec, UNetSpec, VaeDecoderSpec, VaeEncoderSpec, component_spec, spec_from_json
from sdtrt.stages import build_ort, export, simplify
from sdtrt.standins.unet import EngineUNet
from sdtrt.tools.validate import tensor_stats

from .helpers import last_line, run_cli

COMPONENTS = ("text_encoder", "vae_decoder", "vae_encoder")


def reference_outputs(tiny, component: str, feeds: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """What the PyTorch fp32 module gives for the feeds, in the spec's output order."""
    with torch.no_grad():
        if component == "text_encoder":
            out = load_folder(tiny, "text_encoder")(feeds["input_ids"].long(), output_hidden_states=True)
            return [out.last_hidden_state, out.pooler_output, out.hidden_states[-2]]
        vae = load_folder(tiny, "vae")
        if component == "vae_decoder":
            return [vae.decode(feeds["latent_sample"]).sample]
        return [vae.encode(feeds["sample"]).latent_dist.parameters]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("component", COMPONENTS)
def test_component_graph_matches_pytorch_on_onnxruntime(tiny, store, component, precision):
    exported = export.run(ExportConfig(component=component, precision=precision), tiny, store)
    assert exported.primary.name == f"{component}.onnx"
    simplified = simplify.run(SimplifyConfig(), exported, store)
    assert simplified.primary.name == f"{component}.sim.onnx"
    assert simplified.manifest["details"]["check"]["cosine"] >= 0.9999
    spec = artifact_spec(simplified)
    built = build_ort.run(OrtBuildConfig(profile=spec.default_profile()), simplified, store)
    runtime = open_runtime(built, tiny)
    feeds = spec.sample_inputs(2, 128, 192, seed=3)
    got = runtime.run(feeds)
    assert list(got) == list(spec.output_names)
    tol = 1e-4 if precision == "fp32" else 2e-2
    for name, expected in zip(spec.output_names, reference_outputs(tiny, component, feeds), strict=True):
        stats = tensor_stats(got[name], expected)
        print(f"{component} {precision} {name}: cosine {stats['cosine']:.6f}, max abs {stats['max_abs']:.2e}")
        assert got[name].shape == expected.shape
        assert stats["cosine"] >= 0.9999 and stats["max_abs"] <= tol


def test_specs_from_the_tiny_configs(tiny):
    text = component_spec(tiny, "text_encoder")
    assert isinstance(text, TextEncoderSpec) and text.input_names == ("input_ids",)
    assert [t.dtype for t in text.inputs()] == ["int32"], "token ids are int32 in the graph"
    assert text.output_names == ("last_hidden_state", "pooler_output", "penultimate_hidden_state")
    decoder, encoder = component_spec(tiny, "vae_decoder"), component_spec(tiny, "vae_encoder")
    assert isinstance(decoder, VaeDecoderSpec) and isinstance(encoder, VaeEncoderSpec)
    assert decoder.output_shapes({"latent_sample": (2, 4, 16, 24)}) == {"sample": (2, 3, 128, 192)}
    assert encoder.output_shapes({"sample": (1, 3, 64, 64)}) == {"latent_parameters": (1, 8, 8, 8)}
    assert encoder.check_shapes({"sample": (1, 3, 60, 64)}, None) == "image height 60 must be a multiple of 8"
    profile = decoder.default_profile()
    assert decoder.profile_shapes(profile)["latent_sample"][2] == (4, 4, 48, 48)
    for spec in (text, decoder, encoder, component_spec(tiny, "unet")):
        assert spec_from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_manifests_from_before_components_describe_a_unet(tiny):
    old = component_spec(tiny, "unet").to_json()
    del old["component"]
    assert isinstance(spec_from_json(old), UNetSpec)


def test_projected_text_encoders_name_their_pooled_output():
    config = {"hidden_size": 1280, "projection_dim": 1280, "vocab_size": 49408, "max_position_embeddings": 77}
    spec = TextEncoderSpec.from_config(config, "CLIPTextModelWithProjection", 8)
    assert spec.output_names[1] == "text_embeds" and spec.outputs()[1].shape == ("batch", 1280)


def test_fp16_text_encoders_need_the_torch_export_based_exporter():
    assert ExportConfig(component="text_encoder").chosen_exporter == "dynamo"
    assert ExportConfig(component="vae_decoder").chosen_exporter == "torchscript"
    with pytest.raises(ConfigError, match="use --exporter dynamo"):
        ExportConfig(component="text_encoder", exporter="torchscript")
    with pytest.raises(ConfigError, match="component 'vae' is not one of"):
        ExportConfig(component="vae")  # type: ignore[arg-type]


def test_a_bare_unet_folder_has_no_other_components(tiny, tmp_path):
    unet_only = resolve_model(str(tiny.path / "unet"))
    with pytest.raises(ModelNotFoundError, match="has no text_encoder/"):
        component_spec(unet_only, "text_encoder")


def test_non_unet_engines_are_refused_where_only_unets_run(tiny, store):
    decoder = export.run(ExportConfig(component="vae_decoder"), tiny, store)
    with pytest.raises(ArtifactError, match="this is a vae_decoder engine; a pipeline's unet needs a UNet engine"):
        EngineUNet(open_runtime(decoder, tiny), tiny.unet_config())


def test_export_cli_takes_a_component(tmp_path):
    engines = tmp_path / "engines"
    result = run_cli(
        "export", "--component", "vae_encoder", "--precision", "fp32", "--engines", str(engines), check=True
    )
    artifact = Path(last_line(result.stdout))
    assert (artifact / "vae_encoder.onnx").is_file() and "Exporting VAE encoder to ONNX" in result.stderr
    bad = run_cli("export", "--component", "vae", "--engines", str(engines))
    assert bad.returncode == 2 and "vae" in bad.stderr


# ---- engine sets: every component swapped into the diffusers pipeline ----------------------------------------------

ALL = ("unet", "text_encoder", "vae_decoder", "vae_encoder")


@pytest.fixture(scope="module")
def tiny_set(tiny, store):
    from sdtrt.core.config import ValidationConfig
    from sdtrt.tools.compile import compile_model

    result = compile_model(tiny, store, "onnxruntime", components=ALL, validation=ValidationConfig(steps=4))
    return result


def test_compile_validates_every_member_and_the_swapped_image(tiny_set):
    report = tiny_set.validation
    assert report, report.failures
    cases = [row["case"] for row in report.tensors]
    # The profile's optimum, smallest and largest shape each; a text encoder's differ by batch only: 1 and 4.
    assert [case for case in cases if case.startswith("text_encoder ")] == ["text_encoder b1", "text_encoder b4"]
    for component in ("vae_decoder", "vae_encoder"):
        assert sum(case.startswith(component) for case in cases) == 3
    assert report.precision == "text_encoder fp16, unet fp16, vae_decoder fp32, vae_encoder fp32", "force_upcast VAE"
    assert report.image["psnr_db"] >= 35
    final = tiny_set.final
    assert final.stage == "set" and sorted(final.manifest["members"]) == sorted(ALL)


@pytest.mark.parametrize("scheduler", ["euler", "dpm++"])
def test_the_set_drop_in_matches_pytorch(tiny, tiny_set, scheduler):
    from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
    from sdtrt.standins.text_encoders import EngineTextEncoder
    from sdtrt.standins.vae import EngineVAE
    from sdtrt.tools.image_quality import psnr_db

    engine = load_pipeline(tiny, tiny_set, scheduler=scheduler)
    assert isinstance(engine.unet, EngineUNet) and isinstance(engine.text_encoder, EngineTextEncoder)
    assert isinstance(engine.vae, EngineVAE) and engine.vae.config.scaling_factor == 0.18215
    reference = load_pipeline(tiny, scheduler=scheduler)
    request = GenerateRequest(prompt="a red fox", steps=4, height=128, width=192, seed=2, images=2)
    a, b = (generate(p, request, output_type="np").images for p in (reference, engine))
    assert a.shape == b.shape == (2, 128, 192, 3)
    print(f"{scheduler}: PSNR {psnr_db(b, a):.1f} dB")
    assert psnr_db(b, a) >= 35


def test_clip_skip_on_the_text_encoder_engine(tiny, tiny_set):
    from sdtrt.pipeline.loading import load_pipeline

    engine = load_pipeline(tiny, tiny_set)
    embeds, _ = engine.encode_prompt("a red fox", "cpu", 1, False, clip_skip=1)
    # diffusers 0.42's own clip_skip path needs transformers 4's `text_model`; compute the reference by hand.
    reference = load_folder(tiny, "text_encoder")
    ids = engine.tokenizer("a red fox", padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = reference.final_layer_norm(reference(ids, output_hidden_states=True).hidden_states[-2])
    stats = tensor_stats(embeds, expected)
    assert stats["cosine"] >= 0.9999 and stats["max_abs"] <= 2e-2, stats
    with pytest.raises(EngineInputError, match="penultimate hidden state only"):
        engine.encode_prompt("a red fox", "cpu", 1, False, clip_skip=2)


def test_img2img_encodes_with_the_vae_encoder_engine(tiny, tiny_set):
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.tools.image_quality import psnr_db

    init = torch.rand(1, 3, 128, 128, generator=torch.Generator().manual_seed(0))
    kwargs = dict(prompt="a watercolor", image=init, strength=0.6, num_inference_steps=5, output_type="np")
    reference, engine = load_pipeline(tiny, task="img2img"), load_pipeline(tiny, tiny_set, task="img2img")
    a = reference(**kwargs, generator=torch.Generator().manual_seed(1)).images[0]
    b = engine(**kwargs, generator=torch.Generator().manual_seed(1)).images[0]
    assert engine.vae.encoder_runtime is not None and psnr_db(b, a) >= 35


def test_a_set_without_some_members_keeps_pytorch_for_them(tiny, store, tiny_set, capsys):
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.stages import engine_set
    from sdtrt.stages.engine_set import EngineSetConfig

    members = engine_set.members(tiny_set.final)
    partial = engine_set.run(
        EngineSetConfig(("unet", "vae_decoder")), {c: members[c] for c in ("unet", "vae_decoder")}, store, tiny
    )
    pipe = load_pipeline(tiny, partial)
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel" and isinstance(pipe.unet, EngineUNet)
    assert "on PyTorch (not in the engine set): text_encoder, vae_encoder" in capsys.readouterr().err


def test_sets_are_cache_hits_and_unet_alone_is_todays_result(tiny, store, tiny_set):
    from sdtrt.tools.compile import compile_model

    again = compile_model(tiny, store, "onnxruntime", components=ALL)
    assert again.final.path == tiny_set.final.path
    assert compile_model(tiny, store, "onnxruntime", components=("unet",)).final.stage == "build-ort"


def test_members_from_different_models_are_refused(tiny, store, tiny_set, tmp_path):
    import shutil

    from sdtrt.stages import engine_set
    from sdtrt.stages.engine_set import EngineSetConfig

    other = tmp_path / "other"
    shutil.copytree(tiny.path, other)
    vae = load_folder(tiny, "vae")
    with torch.no_grad():
        for p in vae.parameters():
            p.mul_(1.01)
    vae.save_pretrained(other / "vae")
    decoder = export.run(ExportConfig(component="vae_decoder", precision="fp32"), resolve_model(str(other)), store)
    unet = engine_set.members(tiny_set.final)["unet"]
    before = len(store.artifacts())
    with pytest.raises(ArtifactError, match=r"members come from different models: vae_decoder not from tiny's"):
        engine_set.run(EngineSetConfig(("unet", "vae_decoder")), {"unet": unet, "vae_decoder": decoder}, store, tiny)
    assert len(store.artifacts()) == before, "nothing half-written"


def test_bad_components_and_missing_members_are_one_line_errors(tiny, tiny_set, tmp_path):
    import shutil

    engines = tmp_path / "engines"
    unknown = run_cli("compile", "--components", "unet,vae", "--engines", str(engines))
    assert unknown.returncode == 2 and "unknown component 'vae'" in unknown.stderr
    assert "vision_encoder (Qwen-Image-Edit's vision tower)" in unknown.stderr  # a network --components names
    bare = run_cli(
        "compile", "--model", str(tiny.path / "unet"), "--components", "text_encoder", "--engines", str(engines)
    )
    assert bare.returncode == 2 and "has no text_encoder (it has unet)" in bare.stderr
    assert not (engines / "export").exists(), "refused before anything is exported"

    copied = tmp_path / "store"
    shutil.copytree(tiny_set.final.path.parent.parent, copied)
    set_dir = copied / "set" / tiny_set.final.path.name
    member = Artifact.open(set_dir).manifest["members"]["vae_decoder"]
    shutil.rmtree(copied / member["stage"] / member["key"][:16])
    result = run_cli("generate", "--engine", str(set_dir), "--steps", "1", "--out", str(tmp_path / "x.png"))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "lists its vae_decoder as" in result.stderr and "no longer in the store" in result.stderr


def test_components_names_qwen_image_edits_vision_tower():
    """Qwen-Image-Edit's vision tower is one of its networks (model_components), so --components takes it."""
    from sdtrt.cli.stages import parse_components

    assert parse_components("vision_encoder,text_encoder", resolve_model("tiny-qwen-image-edit")) == (
        "vision_encoder", "text_encoder"
    )  # fmt: skip
    with pytest.raises(RequestError, match=r"^model 'tiny-qwen-image' has no vision_encoder \(it has"):
        parse_components("vision_encoder", resolve_model("tiny-qwen-image"))
