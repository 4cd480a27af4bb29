"""DeepCache on UNet engines: the UNet cut into its deep pass and shallow branch (compile's caches=("deepcache",)),
checked against the whole UNet and the ``deepcache`` package in PyTorch, then run by sdtrt.DeepCache in engine
pipelines of SD 1.x (PNDM, which repeats a timestep) and SDXL (Euler) on ONNX Runtime, fp32."""

from __future__ import annotations

import itertools
import re
from functools import partial

import numpy as np
import pytest
import torch

from sdtrt import (
    ConfigError,
    DeepCache,
    EngineInputError,
    ExportConfig,
    ShapeProfile,
    Store,
    ValidationConfig,
)
from sdtrt.core.config.shapes import Range
from sdtrt.pipeline.loading import engine_members, load_pipeline, set_loras
from sdtrt.pipeline.step_cache import StepCache
from sdtrt.sources.models import load_folder, resolve_model
from sdtrt.spec import UNetSpec
from sdtrt.spec.unet_split import DEEP_FEATURE, UNetDeepSpec, UNetShallowSpec
from sdtrt.stages.graph_module import graph_module, unet_extras
from sdtrt.tools.compile import compile_model
from sdtrt.tools.validate import psnr_db

from .helpers import peft_lora, run_cli

PRESETS = ("tiny", "tiny-sdxl")
# The tiny presets' UNets have two blocks of one layer (two per up block); "sd-layout" has SD's three layers per up
# block, so that a cut can leave layers of its up block on both sides while the mirror down block runs some of its own.
LAYOUTS = (*PRESETS, "sd-layout")
NO_PACKAGE = "needs the dev extra's deepcache package, the PyTorch reference: pip install deepcache==0.1.1"
# Small, so that compiling and validating two engine sets stays quick.
PROFILE = ShapeProfile(Range(1, 1, 1), Range(64, 128, 128), Range(64, 128, 128))


@pytest.fixture(scope="module")
def deepcache_set(tmp_path_factory):
    """preset → compile's result for its UNet with the DeepCache members (fp32 ONNX Runtime), each member validated
    against PyTorch (no image comparison: the DeepCache tests below compare images)."""
    store = Store(tmp_path_factory.mktemp("deepcache-engines"))
    built = {}

    def get(preset: str):
        if preset not in built:
            built[preset] = compile_model(
                resolve_model(preset), store, "onnxruntime", ExportConfig(precision="fp32"), profile=PROFILE,
                components=("unet",), caches=("deepcache",), validation=ValidationConfig(images=False),
            )  # fmt: skip
        return built[preset]

    return get


@pytest.fixture(scope="module")
def unet_model(tmp_path_factory):
    """A LAYOUTS name → its model: a preset, or for "sd-layout" a bare UNet folder, tiny's widened to SD 1.x's
    layout (three blocks, two layers per down block) with random weights."""
    from diffusers import UNet2DConditionModel

    folder = tmp_path_factory.mktemp("sd-layout")
    torch.manual_seed(0)
    UNet2DConditionModel.from_config(
        resolve_model("tiny").unet_config() | {
            "layers_per_block": 2, "block_out_channels": (32, 64, 64),
            "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        }
    ).save_pretrained(folder)  # fmt: skip
    return lambda name: resolve_model(str(folder) if name == "sd-layout" else name)


def branches(model) -> range:
    """Every DeepCache branch of the model's UNet: three per up block."""
    return range(3 * len(model.unet_config()["up_block_types"]))


def part_specs(model, branch: int) -> tuple[UNetDeepSpec, UNetShallowSpec]:
    deep, shallow = (cls.at_branch(model, branch, "fp32") for cls in (UNetDeepSpec, UNetShallowSpec))
    assert isinstance(deep, UNetDeepSpec) and isinstance(shallow, UNetShallowSpec)
    return deep, shallow


def shallow_feeds(spec: UNetShallowSpec, feeds: dict, feature: torch.Tensor) -> list[torch.Tensor]:
    return [feature if name == DEEP_FEATURE else feeds[name] for name in spec.canonical_inputs]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_deep_pass_and_the_shallow_branch_are_the_whole_unet_bit_for_bit(unet_model, layout):
    """At every branch: the deep pass's output is the UNet's; the shallow branch on the deep pass's feature of the
    same step is the UNet's too (torch, fp32, the very modules the exporter traces). On the latent grid the feature
    has the spec's shape; off it (latents 5×7, which no graph takes) the parts still compute the forward, whose up
    blocks then resize to the skip features' sizes."""
    model = unet_model(layout)
    unet, whole = load_folder(model, "unet"), UNetSpec.for_model(model, "fp32")
    for height, width in ((64, 96), (40, 56)):
        feeds = whole.sample_inputs(2, height, width, seed=1, timestep=321.0)
        on_grid = not whole.check_shapes(whole.input_shapes(2, height, width), None)
        with torch.no_grad():
            expected = graph_module(whole, unet)(*feeds.values())
            for branch in branches(model):
                deep, shallow = part_specs(model, branch)
                out, feature = graph_module(deep, unet)(*feeds.values())
                if on_grid:
                    assert feature.shape == shallow.input_shapes(2, height, width)[DEEP_FEATURE], branch
                assert torch.equal(out, expected), branch
                out = graph_module(shallow, unet)(*shallow_feeds(shallow, feeds, feature))
                assert torch.equal(out, expected), (branch, height)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_shallow_branch_computes_the_packages_skipped_step_bit_for_bit(unet_model, layout):
    """DeepCacheSDHelper on the PyTorch UNet, a full step then a skipped one, at every branch: the shallow branch on
    the deep pass's feature of the full step computes the skipped step exactly."""
    package = pytest.importorskip("DeepCache", reason=NO_PACKAGE)
    from types import SimpleNamespace

    model = unet_model(layout)
    unet, whole = load_folder(model, "unet"), UNetSpec.for_model(model, "fp32")
    full, skipped = (whole.sample_inputs(2, 64, 96, seed=s, timestep=t) for s, t in ((1, 900.0), (2, 800.0)))
    # What DeepCacheSDHelper reads of a pipeline: its UNet, and its scheduler's timesteps to count steps.
    pipe = SimpleNamespace(unet=unet, scheduler=SimpleNamespace(timesteps=torch.tensor([900, 800])))

    def unet_step(feeds: dict) -> torch.Tensor:
        extras = unet_extras(whole, tuple(feeds.values())[3:])
        return unet(feeds["sample"], feeds["timestep"][0], feeds["encoder_hidden_states"], **extras)[0]

    with torch.no_grad():
        for branch in branches(model):
            helper = package.DeepCacheSDHelper(pipe)
            helper.set_params(cache_interval=2, cache_branch_id=branch)
            helper.enable()
            expected = [unet_step(full), unet_step(skipped)]
            helper.disable()
            deep, shallow = part_specs(model, branch)
            out, feature = graph_module(deep, unet)(*full.values())
            assert torch.equal(out, expected[0]), branch
            out = graph_module(shallow, unet)(*shallow_feeds(shallow, skipped, feature))
            assert torch.equal(out, expected[1]), branch
            assert not torch.equal(out, unet_step(skipped))  # the skipped step is not the step run whole


@pytest.mark.parametrize("preset", PRESETS)
def test_compile_builds_and_validates_the_deepcache_members(deepcache_set, preset):
    result = deepcache_set(preset)
    members = engine_members(result.final)
    assert set(members) == {"unet", "unet_deep", "unet_shallow"}
    report = result.validation
    assert report, report.failures
    checked = {row["case"].split()[0] for row in report.tensors}
    assert checked == {"unet", "unet_deep", "unet_shallow"}
    assert max(row["max_abs"] for row in report.tensors) < 1e-4
    # SDXL's outer blocks have no cross-attention: its shallow branch takes no text (SD 1.x's does).
    shallow = UNetShallowSpec.for_model(resolve_model(preset), "fp32")
    assert ("encoder_hidden_states" in shallow.canonical_inputs) == (preset == "tiny")


def generate(pipe, full_steps, steps: int = 10) -> tuple[np.ndarray, str]:
    """The image of one seeded call, and which of its steps ran the whole UNet (F) or reused the feature (S), read
    from ``full_steps()``: how many whole-UNet runs there were so far."""
    counts = [full_steps()]

    def on_step(_pipe, _i, _t, kwargs):
        counts.append(full_steps())
        return kwargs

    image = pipe(
        "a red fox in the snow", num_inference_steps=steps, height=128, width=128, output_type="np",
        generator=torch.Generator().manual_seed(0), callback_on_step_end=on_step,
    ).images[0]  # fmt: skip
    return image, "".join("F" if b > a else "S" for a, b in itertools.pairwise(counts))


def whole_unet_runs(module: torch.nn.Module) -> list[int]:
    """A counter of the module's runs (the package returns the mid block's cached output without running it)."""
    runs = [0]
    module.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    return runs


# PNDM repeats its second timestep: at interval 2 only counting steps by timestep index, as the package does, skips
# the steps it skips (FSSSFSFSFSF, where counting calls would give FSFSFSFSFSF).
@pytest.mark.parametrize(("preset", "interval"), [("tiny", 3), ("tiny-sdxl", 3), ("tiny", 2)])
def test_engines_skip_the_steps_the_package_skips_and_draw_its_image(deepcache_set, preset, interval):
    package = pytest.importorskip("DeepCache", reason=NO_PACKAGE)
    reference = load_pipeline(preset)
    helper = package.DeepCacheSDHelper(reference)
    helper.set_params(cache_interval=interval, cache_branch_id=0)
    helper.enable()
    runs = whole_unet_runs(reference.unet.mid_block.resnets[0])
    want_image, want = generate(reference, lambda: runs[0])

    pipe = load_pipeline(preset, deepcache_set(preset))
    cache = DeepCache(pipe)
    cache.set_params(cache_interval=interval, cache_branch_id=0)
    cache.enable()
    deep = pipe.unet.opened_split().deep
    image, got = generate(pipe, lambda: deep.calls)
    print(f"{preset} interval {interval}: {got} (package: {want}), PSNR {psnr_db(image, want_image):.1f} dB")
    assert got == want and "S" in got
    assert psnr_db(image, want_image) >= 35
    assert pipe.unet.deepcache.last is None  # the pipeline's end of call (maybe_free_model_hooks) reset the count
    again, got_again = generate(pipe, lambda: deep.calls)  # the next call counts its steps from its own first
    assert got_again == want and np.array_equal(again, image)


@pytest.mark.parametrize("preset", PRESETS)
def test_disable_gives_the_uncached_image_bit_for_bit(deepcache_set, preset):
    pipe = load_pipeline(preset, deepcache_set(preset))
    uncached, _ = generate(pipe, lambda: 0)
    cache = DeepCache(pipe)
    cache.set_params(cache_interval=3)
    cache.enable()
    cached, _ = generate(pipe, lambda: 0)
    cache.disable()
    again, _ = generate(pipe, lambda: 0)
    assert not np.array_equal(cached, uncached)
    assert np.array_equal(again, uncached)


def test_deepcache_is_refused_without_its_members_or_at_another_branch(deepcache_set, tmp_path):
    plain = load_pipeline("tiny", engine_members(deepcache_set("tiny").final)["unet"])
    with pytest.raises(EngineInputError, match="sdtrt compile --caches deepcache"):
        DeepCache(plain).enable()

    pipe = load_pipeline("tiny", deepcache_set("tiny"))
    cache = DeepCache(pipe)
    cache.set_params(cache_interval=3, cache_branch_id=1)
    with pytest.raises(EngineInputError, match="cut at cache_branch_id=0, not 1"):
        cache.enable()
    with pytest.raises(EngineInputError, match="skip_mode"):
        cache.set_params(skip_mode="non-uniform")
    with pytest.raises(EngineInputError, match="cache_interval 0"):
        cache.set_params(cache_interval=0)

    cache.set_params(cache_interval=3)
    cache.enable()
    lora = peft_lora(resolve_model("tiny"), tmp_path, seed=1, rank=4, alpha=8)
    set_loras(pipe, [(lora, 1.0)])  # while DeepCache is on: into both members (test_loras_go_into_the_members)
    cache.disable()

    with pytest.raises(EngineInputError, match="runs on PyTorch"):
        DeepCache(load_pipeline("tiny")).enable()
    with pytest.raises(EngineInputError, match="StableDiffusion3Pipeline has none"):
        DeepCache(load_pipeline("tiny-sd3")).enable()


def test_loras_go_into_the_members_as_into_the_unet(deepcache_set, tmp_path):
    """A LoRA set while DeepCache is on reaches its members: every step full (interval 1, the deep member) gives the
    whole UNet engine's LoRA image, and the shallow steps between change it as without a LoRA."""
    lora = peft_lora(resolve_model("tiny"), tmp_path, seed=1, rank=4, alpha=8)
    pipe = load_pipeline("tiny", deepcache_set("tiny"))
    run = partial(generate, pipe, lambda: 0)
    set_loras(pipe, [(lora, 1.0)])
    with_lora, _ = run()
    cache = DeepCache(pipe)
    cache.set_params(cache_interval=1)
    cache.enable()
    every_step, _ = run()
    assert psnr_db(every_step, with_lora) >= 100  # the deep member is the whole UNet with the LoRA
    cache.disable()
    set_loras(pipe, [])
    base, _ = run()
    cache.set_params(cache_interval=3)
    cache.enable()
    set_loras(pipe, [(lora, 1.0)])  # while on: into the members opened already
    cached, _ = run()
    assert 25 < psnr_db(cached, with_lora) < 80 and psnr_db(cached, base) < 30
    cache.disable()


def test_compile_refuses_deepcache_where_no_unet_can_take_it(store):
    with pytest.raises(ConfigError, match="deepcache cannot run on tiny-sd3: its denoiser is a transformer"):
        compile_model(resolve_model("tiny-sd3"), store, "onnxruntime", caches=("deepcache",))
    with pytest.raises(ConfigError, match="first-block cannot run on tiny: its denoiser is a UNet; use --caches deep"):
        compile_model(resolve_model("tiny"), store, "onnxruntime", caches=("first-block",))
    with pytest.raises(ConfigError, match="no ControlNet residuals"):
        compile_model(resolve_model("tiny-controlnet"), store, "onnxruntime", caches=("deepcache",))


def test_a_triton_deployment_takes_deepcache_on_a_set_with_its_members(deepcache_set, tmp_path):
    from sdtrt.serving.deploy import TritonDeployConfig, deploy_triton

    engine = deepcache_set("tiny").final
    written = deploy_triton(engine, tmp_path / "repo", TritonDeployConfig(max_batch=1, cache="deepcache:3"))
    assert written.cache == StepCache("deepcache", 3.0)
    used = run_cli("generate", "--engine", str(engine.path), "--cache", "deepcache", "--steps", "6",
                   "--height", "128", "--width", "128", "--out", str(tmp_path / "x.png"), check=True)  # fmt: skip
    full = re.search(r"--cache deepcache:3: the full network ran on (\d+) of 7 denoiser calls", used.stderr)
    assert full and 1 < int(full[1]) < 7, used.stderr  # PNDM's 6 steps are 7 calls
