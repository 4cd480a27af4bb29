"""IP-Adapter on denoiser engines: a random adapter made offline in the published layout (h94/IP-Adapter's for a UNet,
XLabs' for Flux: diffusers' load_ip_adapter reads it), compiled into the denoiser (compile's ExportConfig(ip_adapter=…),
``--ip-adapter``), run by diffusers' own IP-Adapter API on engine pipelines of SD 1.x, SDXL and Flux on ONNX Runtime
(fp32) against diffusers' PyTorch pipeline with the same adapter loaded; refused in one line where the engines were
compiled without it or cannot take it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from sdtrt import (
    ArtifactError,
    ConfigError,
    EngineInputError,
    ExportConfig,
    ModelNotFoundError,
    RequestError,
    ShapeProfile,
    Store,
    ValidationConfig,
)
from sdtrt.core.config.shapes import Range
from sdtrt.core.trt_products import rtx_missing
from sdtrt.pipeline.loading import engine_members, load_pipeline
from sdtrt.sources import ip_adapters
from sdtrt.sources.ip_adapters import (
    IMAGE_ENCODER,
    RANDOM_WEIGHTS,
    TINY_IMAGE_ENCODER,
    random_ip_adapter,
    resolve_ip_adapter,
)
from sdtrt.sources.models import resolve_model
from sdtrt.spec import denoiser_component
from sdtrt.stages import export
from sdtrt.stages.ip_adapter import reference_network
from sdtrt.standins.image_encoder import EngineImageEncoder
from sdtrt.tools.compile import compile_model
from sdtrt.tools.image_quality import psnr_db

from .helpers import last_line, run_cli

PRESETS = ("tiny", "tiny-sdxl", "tiny-flux")
PROFILE = ShapeProfile(Range(1, 1, 1), Range(64, 128, 128), Range(64, 128, 128))
# Per-layer scales: InstantStyle's per-block dict (diffusers' docs: style only) on the tiny UNets' blocks with
# attention (SD 1.x's second up block, SDXL's first; half the scale on the down blocks), one per block for Flux's.
STYLE = {"tiny": {"down": 0.5, "up": {"block_1": [0.0, 1.0]}},
         "tiny-sdxl": {"down": 0.5, "up": {"block_0": [0.0, 1.0]}}, "tiny-flux": [0.7]}  # fmt: skip


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """preset → folder of its random IP-Adapter (weight file + image_encoder/)."""
    root = tmp_path_factory.mktemp("ip-adapters")
    return {preset: random_ip_adapter(resolve_model(preset), root / preset).weights.parent for preset in PRESETS}


@pytest.fixture(scope="module")
def ip_set(tmp_path_factory, adapters):
    """preset → compile's result for its UNet with the IP-Adapter (fp32 ONNX Runtime), validated against PyTorch
    (tensors; the tests below compare images)."""
    store = Store(tmp_path_factory.mktemp("ip-adapter-engines"))
    built = {}

    def get(preset: str):
        if preset not in built:
            model = resolve_model(preset)
            config = ExportConfig(precision="fp32", ip_adapter=str(adapters[preset] / RANDOM_WEIGHTS))
            flux = denoiser_component(model) == "transformer"  # no batch doubling
            built[preset] = compile_model(
                model, store, "onnxruntime", config, profile=replace(PROFILE, guidance=not flux),
                components=(denoiser_component(model),), validation=ValidationConfig(images=False),
            )  # fmt: skip
        return built[preset]

    return get


def ip_image() -> Image.Image:
    return Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype("uint8"))


def generate(pipe, **kwargs) -> np.ndarray:
    return pipe(
        "a red fox in the snow", num_inference_steps=4, height=128, width=128, output_type="np",
        generator=torch.Generator().manual_seed(0), **kwargs,
    ).images[0]  # fmt: skip


def test_the_unet_graph_takes_the_image_embeds_and_scales_and_its_key_the_adapters_digest(ip_set, adapters, tmp_path):
    model = resolve_model("tiny")
    result = ip_set("tiny")
    assert result.validation, result.validation.failures
    assert {row["case"].split()[0] for row in result.validation.tensors} == {"unet", "image_encoder"}
    assert max(row["max_abs"] for row in result.validation.tensors) < 1e-4
    assert result.final.manifest["reproduce"].endswith(
        f"--components unet --ip-adapter {adapters['tiny']}/{RANDOM_WEIGHTS}"
    )
    for member in ("unet", "image_encoder"):  # export takes no adapter: its graphs come again from compile
        graph = next(a for a in engine_members(result.final)[member].lineage() if a.stage == "export")
        command = graph.manifest["reproduce"]
        assert command.startswith("sdtrt compile --model tiny --target onnxruntime --components unet")
        compile_command = cli().get_command(cli().make_context("sdtrt", ["compile"]), "compile")
        parsed = compile_command.make_context("compile", shlex.split(command)[2:]).params  # it parses
        assert parsed["ip_adapter"] == f"{adapters['tiny']}/{RANDOM_WEIGHTS}"
        assert "--exporter" not in command  # auto's, each member's own (the image encoder's is not the UNet's)
    # Moved: validation's PyTorch side loads the files from the path the (next) compile names, not the recorded one.
    moved = adapters["tiny"].with_name("tiny-moved")
    adapters["tiny"].rename(moved)
    try:
        member = engine_members(result.final)["image_encoder"]
        with pytest.raises(ArtifactError, match=r"whose files PyTorch loads here and are gone.*put them back there"):
            reference_network(None, model, "image_encoder", member)
        given = resolve_ip_adapter(moved / RANDOM_WEIGHTS)
        assert reference_network(None, model, "image_encoder", member, given)[0].config.projection_dim == 32
    finally:
        moved.rename(adapters["tiny"])
    io = {t["name"]: t["shape"] for t in engine_members(result.final)["unet"].manifest["io"]["inputs"]}
    assert io["image_embeds"] == ["batch", 1, 32] and io["ip_adapter_scale"] == [4]  # 4 cross-attention layers
    plain = export.request_for(ExportConfig(precision="fp32"), model)
    assert "ip_layers" not in export.spec_for(model, ExportConfig()).to_json()  # a plain UNet's key is as it was
    other = random_ip_adapter(model, tmp_path, seed=1).weights
    keys = {plain.key} | {
        export.request_for(ExportConfig(precision="fp32", ip_adapter=str(weights)), model).key
        for weights in (adapters["tiny"] / RANDOM_WEIGHTS, other)
    }
    assert len(keys) == 3  # the adapter's weights are in the key


# SDXL's and Flux's cases run the same code as SD 1.x's on other graphs (34 and 30 s): slow.
@pytest.mark.parametrize("preset", ["tiny", *(pytest.param(p, marks=pytest.mark.slow) for p in PRESETS[1:])])
def test_engine_ip_adapter_draws_diffusers_images_at_each_scale_and_unloaded_the_plain_one(ip_set, adapters, preset):
    reference = load_pipeline(preset)
    # Flux's loader takes the image encoder from a path of its own (XLabs' files hold none).
    encoder = {"image_encoder_pretrained_model_name_or_path": str(adapters[preset] / "image_encoder")}
    reference.load_ip_adapter(
        str(adapters[preset]), subfolder="", weight_name=RANDOM_WEIGHTS, **(encoder if preset == "tiny-flux" else {})
    )
    compiled = ip_set(preset)
    moved = adapters[preset].with_name(f"{preset}-moved")
    adapters[preset].rename(moved)  # the set loads without the adapter's files: its image encoder is an engine
    try:
        pipe = load_pipeline(preset, compiled)
    finally:
        moved.rename(adapters[preset])
    assert isinstance(pipe.image_encoder, EngineImageEncoder)  # the pipeline's encode_image runs over the engine
    pipe.load_ip_adapter(str(adapters[preset]), subfolder="", weight_name=RANDOM_WEIGHTS)  # the same: accepted
    images = {}
    for label, scale in (("1.0", 1.0), ("0.4", 0.4), ("style", STYLE[preset]), ("0.0", 0.0)):
        for each in (pipe, reference):
            each.set_ip_adapter_scale(scale)
        images[label] = generate(pipe, ip_adapter_image=ip_image())
        want = generate(reference, ip_adapter_image=ip_image())
        print(f"{preset} IP-Adapter scale {label}: engine vs PyTorch {psnr_db(images[label], want):.1f} dB")
        assert psnr_db(images[label], want) >= 35
    pipe.unload_ip_adapter()
    plain = generate(pipe)  # the plain denoiser's image: scale 0 draws it, unloaded too
    assert pipe.image_encoder is None and psnr_db(images["0.0"], plain) >= 35
    assert psnr_db(images["1.0"], images["0.4"]) < 35 and psnr_db(images["1.0"], plain) < 35  # the scale tells
    pipe.load_ip_adapter(str(adapters[preset]), subfolder="", weight_name=[RANDOM_WEIGHTS])  # back, at scale 1
    assert psnr_db(generate(pipe, ip_adapter_image=ip_image()), images["1.0"]) >= 35


def test_ip_adapter_is_refused_where_the_engines_lack_it_or_cannot_take_it(
    ip_set, adapters, tmp_path, store, monkeypatch
):
    pipe = load_pipeline("tiny", ip_set("tiny"))
    other = random_ip_adapter(resolve_model("tiny"), tmp_path, seed=1).weights
    with pytest.raises(EngineInputError, match="not the IP-Adapter this engine was compiled with"):
        pipe.load_ip_adapter(str(tmp_path), subfolder="", weight_name=other.name)
    for args, why in (
        (({"image_proj": {}, "ip_adapter": {}}, "", ""), "a state dict has no file"),
        (("h94/IP-Adapter", "models", "ip-adapter-plus_sd15.safetensors"), "not in the Hugging Face cache either"),
        ((str(tmp_path), "", "gone.safetensors"), "gone.safetensors is no file here"),
        ((str(tmp_path), "", ""), "no weight_name was given"),
    ):
        with pytest.raises(EngineInputError, match=f"load_ip_adapter: this engine holds its IP-Adapter.*{why}"):
            pipe.load_ip_adapter(*args)
    # A hub id is its file in the local Hugging Face cache: this engine's adapter, or another one refused.
    for cached, accepted in ((adapters["tiny"] / RANDOM_WEIGHTS, True), (other, False)):
        monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda repo, name, path=str(cached): path)
        if accepted:
            pipe.load_ip_adapter("someone/ip-adapter", subfolder="models", weight_name=RANDOM_WEIGHTS)
        else:
            with pytest.raises(EngineInputError, match="not the IP-Adapter this engine was compiled with"):
                pipe.load_ip_adapter("someone/ip-adapter", subfolder="models", weight_name=RANDOM_WEIGHTS)
    with pytest.raises(EngineInputError, match="gives a scale per IP image, and the engine takes one IP image"):
        pipe.set_ip_adapter_scale([[0.5, 0.7]])
    with pytest.raises(EngineInputError, match="ip_adapter_masks: masked IP-Adapter images are not built"):
        masks = {"ip_adapter_masks": [torch.ones(1, 1, 8, 8)]}
        generate(pipe, ip_adapter_image=ip_image(), cross_attention_kwargs=masks)
    weights = str(adapters["tiny"] / RANDOM_WEIGHTS)
    with pytest.raises(ConfigError, match=r"IP-Adapter on tiny-sd3's transformer engines is not built yet"):
        compile_model(resolve_model("tiny-sd3"), store, "onnxruntime", ExportConfig(ip_adapter=weights))
    with pytest.raises(ConfigError, match="the FreeU build would run without it"):
        compile_model(resolve_model("tiny"), store, "onnxruntime", ExportConfig(ip_adapter=weights), freeu=True)
    done = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", "--ip-adapter", str(tmp_path / "none"))
    assert done.returncode == 2 and "no such .safetensors or .bin file" in last_line(done.stderr)
    (tmp_path / "style.png").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="goes to `sdtrt generate --ip-adapter-image`"):
        resolve_ip_adapter(tmp_path / "style.png")


def copy_adapter(adapter, folder, drop=()) -> str:
    """The adapter's weight file in ``folder`` without the tensors whose names start with one of ``drop``."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    shutil.copytree(adapter / IMAGE_ENCODER, folder / IMAGE_ENCODER)
    kept = {k: v for k, v in load_file(adapter / RANDOM_WEIGHTS).items() if not k.startswith(drop)}
    save_file(kept, folder / RANDOM_WEIGHTS)
    return str(folder / RANDOM_WEIGHTS)


def test_an_adapter_that_does_not_fit_is_refused_from_its_header_before_any_export(adapters, tmp_path, monkeypatch):
    model, weights = resolve_model("tiny"), str(adapters["tiny"] / RANDOM_WEIGHTS)
    monkeypatch.setattr(export, "run", lambda *a, **k: pytest.fail("exported before the adapter was checked"))
    monkeypatch.setattr(ip_adapters.IPAdapterFiles, "state_dict", lambda self: pytest.fail("loaded the weights"))
    hashed, sha256 = [], ip_adapters.file_sha256
    monkeypatch.setattr(ip_adapters, "file_sha256", lambda path: hashed.append(path) or sha256(path))

    def refusal(model, **fields) -> str:
        with pytest.raises(ConfigError) as caught:
            compile_model(model, Store(tmp_path / "store"), "onnxruntime", ExportConfig(**fields))
        return str(caught.value)

    assert "tiny-sdxl: its image projection makes 32-wide tokens and tiny-sdxl's cross_attention_dim is 64" in (
        refusal(resolve_model("tiny-sdxl"), ip_adapter=weights)
    )
    encoder = tmp_path / "vit-h"  # diffusers' image_encoder_folder: another encoder than the one beside the file
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps(dict(TINY_IMAGE_ENCODER, projection_dim=48)))
    assert "takes 32-wide image embeds and the image encoder" in refusal(
        model, ip_adapter=weights, ip_adapter_image_encoder=str(encoder)
    )
    missing_layer = copy_adapter(adapters["tiny"], tmp_path / "three", drop=("ip_adapter.7.",))
    assert "it has 3 attention layers and tiny's denoiser 4" in refusal(model, ip_adapter=missing_layer)
    plus = copy_adapter(adapters["tiny"], tmp_path / "plus", drop=("image_proj.norm",))
    assert "is not a plain IP-Adapter" in refusal(model, ip_adapter=plus)
    assert "a loaded denoiser" in refusal(model, ip_adapter=weights, weights="stream")
    assert "IP-Adapter on sd2-v engines is not built yet" in refusal(resolve_model("tiny-sd2"), ip_adapter=weights)
    # Under --weights auto an IP denoiser is exported loaded, where streaming would be picked (bf16, torch.export's
    # exporter, a big folder); its adapter hashed once per process while the file stays.
    fresh = random_ip_adapter(model, tmp_path / "fresh", seed=2).weights
    config = ExportConfig(ip_adapter=str(fresh), precision="bf16", exporter="dynamo")
    monkeypatch.setattr("sdtrt.graph.onnx_weights.weights_size", lambda folder: 1 << 40)
    assert export.weights_path(config, export.spec_for(model, config), model) == (
        "load", "diffusers loads an IP-Adapter into a loaded denoiser"
    )  # fmt: skip
    plain = replace(config, ip_adapter="")
    assert export.weights_path(plain, export.spec_for(model, plain), model)[0] == "stream"
    export.request_for(config, model), export.request_for(config, model)
    assert hashed == [fresh]


@pytest.mark.skipif(bool(rtx_missing()), reason=f"builds TensorRT-RTX plans: {rtx_missing()}")
@pytest.mark.parametrize(
    ("preset", "components"),
    [("tiny", ("unet", "image_encoder")), pytest.param("tiny-flux", ("transformer",), marks=pytest.mark.slow)],
)
def test_the_ip_adapter_denoiser_and_image_encoder_build_as_tensorrt_rtx_plans(adapters, store, preset, components):
    """The fp16 graphs, the denoiser's scales an fp32 input, as real TensorRT-RTX plans."""
    from sdtrt.core.config import SimplifyConfig
    from sdtrt.stages import simplify
    from sdtrt.tools.compile import build

    model, weights = resolve_model(preset), str(adapters[preset] / RANDOM_WEIGHTS)
    for component in components:
        graph = export.run(ExportConfig(component=component, ip_adapter=weights), model, store)
        plan, _ = build(simplify.run(SimplifyConfig(), graph, store), store, "tensorrt-rtx")
        assert plan.manifest["details"]["layer_types"].get("HALF"), plan.manifest["details"]["layers"]
        assert (plan.path / plan.manifest["primary"]).stat().st_size > 0


def test_generate_takes_an_ip_adapter_image_and_refuses_it_without_the_adapter(ip_set, tmp_path):
    picture, image, size = tmp_path / "ip.png", tmp_path / "out.png", ("--height", "128", "--width", "128")
    ip_image().save(picture)
    done = run_cli("generate", "--engine", str(ip_set("tiny").final.path), "--ip-adapter-image", str(picture),
                   "--ip-adapter-scale", "0.6", "--steps", "2", *size, "--out", str(image))  # fmt: skip
    assert done.returncode == 0 and image.is_file(), done.stderr
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):  # `cache ls` names the adapter folder an image encoder came from
        cli().main(["cache", "ls", "--engines", str(ip_set("tiny").final.path.parents[1])], standalone_mode=False)
    export_row = next(row.split() for row in listing.getvalue().splitlines() if row.startswith("export  ") and
                      " image_encoder " in row)  # fmt: skip
    assert export_row[-2].endswith("/tiny/image_encoder"), listing.getvalue()
    for args, refusal in (  # usage errors (exit 2) before anything loads: run in-process
        (
            ("--ip-adapter-image", str(picture)),
            "a PyTorch pipeline loads no IP-Adapter; compile an engine set with `sdtrt compile --ip-adapter PATH`",
        ),
        (("--ip-adapter-scale", "0.5"), "--ip-adapter-scale scales an --ip-adapter-image"),
    ):
        with pytest.raises(RequestError, match=re.escape(refusal)) as caught:
            cli().main(["generate", "--model", "tiny", *args, *size], standalone_mode=False)
        assert caught.value.exit_code == 2


def cli():
    """sdtrt's command group, run in-process (a usage error raises before any work)."""
    from typer.main import get_command

    from sdtrt.cli import app

    return get_command(app)


def test_ip_adapter_random_from_the_cli_writes_the_seeded_adapter(adapters, tmp_path):
    """`sdtrt ip-adapter random` (what the docs give newcomers to try --ip-adapter offline): the same files as the
    library's seeded random adapter, image encoder beside the weights."""
    cli().main(["ip-adapter", "random", "--model", "tiny", "--out", str(tmp_path)], standalone_mode=False)
    made = resolve_ip_adapter(str(tmp_path))
    assert made.digest() == resolve_ip_adapter(str(adapters["tiny"])).digest()
    assert (made.image_encoder / "config.json").is_file()
