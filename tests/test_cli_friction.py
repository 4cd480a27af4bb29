"""Friction a newcomer met (trial 4): usage errors that came late or in the wrong form, silent waits and cuts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdtrt.core.store import Store
from tests.helpers import REPO, run_cli

# Runs the CLI in this process, then reports which heavy libraries it imported: a usage error must come before them.
HEAVY = ("diffusers", "torch")
PROBE = f"""
import runpy, sys
sys.argv = ["sdtrt", *sys.argv[1:]]
try:
    runpy.run_module("sdtrt", run_name="__main__")
finally:
    print("imported:", *[m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
"""


def usage_error_before_loading(*args: str) -> str:
    """The one ``error:`` line of a usage error (exit 2) that came before diffusers or torch were imported."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=os.environ | {"SDTRT_DEBUG": "0"},
        cwd=REPO, stdin=subprocess.DEVNULL, timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    error, imported = result.stderr.strip().splitlines()
    assert error.startswith("error: ") and imported == "imported:", result.stderr
    return error


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("pictures")
    Image.new("RGB", (64, 64)).save(folder / "in.png")
    Image.new("L", (64, 64)).save(folder / "mask.png")
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image", "{in}"], "this model's pipeline takes no image: pass --task img2img"),
        (["--mask", "{mask}"], "takes no mask image: pass --task inpaint and an --image"),
        (["--task", "img2img", "--image", "{in}", "--mask", "{mask}"], "takes no mask image: pass --task inpaint"),
        (
            ["--model", "tiny-inpaint"],
            "this model's pipeline, StableDiffusionInpaintPipeline (an inpaint one; no --task was given), needs an "
            "input image: pass --image",
        ),
        (["--model", "tiny-inpaint", "--image", "{in}"], "(an inpaint one; no --task was given), needs a mask image"),
        (
            ["--model", "tiny-flux-kontext", "--task", "inpaint", "--mask", "{mask}"],
            "--task inpaint needs an input image: pass --image",
        ),
        (
            ["--model", "tiny-flux-kontext", "--task", "inpaint", "--image", "{in}"],
            "--task inpaint needs a mask image: pass --mask",
        ),
        (  # a reference to inpaint by, on Kontext's img2img pipeline
            ["--model", "tiny-flux-kontext", "--image", "{in}", "--reference-image", "{in}"],
            "takes no image reference (--reference-image is FLUX.1 Kontext and FLUX.2 [klein] inpainting's: --task",
        ),
        (["--model", "tiny-flux2-klein", "--task", "inpaint", "--image", "{in}"], "--task inpaint needs a mask image"),
        (  # klein's inpainting pipeline makes its image's size too
            ["--model", "tiny-flux2-klein", "--task", "inpaint", "--image", "{in}", "--mask", "{mask}", "--width=96"],
            "64×64 px (w×h), not the width 96 asked: diffusers' Flux2KleinInpaintPipeline makes its output's size",
        ),
        (  # the task read from model_index.json, not asked for: the message says so
            ["--model", "tiny-qwen-image-edit"],
            "this model's pipeline, QwenImageEditPipeline (an img2img one; no --task was given), needs an input image",
        ),
        (["--model", "tiny-qwen-image-edit", "--image", "{in}", "--guidance", "4"], "Qwen-Image's pipelines (Edit's"),
        (["--model", "tiny-qwen-image-edit", "--image", "{in}", "--strength", "0.5"], "takes no strength: it draws"),
        (["--model", "tiny-lcm", "--scheduler", "ddim"], "LatentConsistencyModel pipelines step only with lcm or tcd"),
        (["--model", "tiny-lcm", "--task", "inpaint"], "family has no inpaint pipeline (it has txt2img, img2img)"),
        (["--model", "tiny-lcm", "--image", "{in}", "--mask", "{mask}"], "its family has no inpaint pipeline"),
        # SD img2img makes the input's size (held to the grid and profile as on the Triton wire): a height asked is not
        (
            ["--task", "img2img", "--image", "{in}", "--height", "128"],
            "64×64 px (w×h), not the height 128 asked: diffusers' StableDiffusionImg2ImgPipeline makes",
        ),
    ],
)
def test_generate_refuses_inputs_the_pipeline_cannot_take_before_loading_it(args, message, pictures):
    """Read from model_index.json, not from the pipeline class diffusers would import (8 s idle, 30 s under load).
    The preset is made first, here: making it (once per models cache) needs diffusers, refusing must not."""
    from sdtrt.sources.models import resolve_model

    resolve_model(args[args.index("--model") + 1] if "--model" in args else "tiny")
    args = [a.format(**{"in": pictures / "in.png", "mask": pictures / "mask.png"}) for a in args]
    assert message in usage_error_before_loading("generate", *args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "--model", "tiny-qwen-image-edit"], "(an img2img one; no --task was given), needs an input image"),
        (["bench", "--mask", "{mask}"], "takes no mask image: pass --task inpaint and an --image"),
        (["profile", "--task", "inpaint", "--image", "{in}"], "--task inpaint needs a mask image: pass --mask"),
    ],
)
def test_bench_and_profile_refuse_inputs_the_tasks_pipeline_cannot_take_before_loading_it(args, message, pictures):
    """bench and profile take generate's --task, --image and --mask, checked as generate checks them."""
    from sdtrt.sources.models import resolve_model

    resolve_model(args[args.index("--model") + 1] if "--model" in args else "tiny")
    args = [a.format(**{"in": pictures / "in.png", "mask": pictures / "mask.png"}) for a in args]
    out = ["--out", str(pictures / "profile")] if args[0] == "profile" else []
    assert message in usage_error_before_loading(*args, *out)


@pytest.mark.parametrize(
    ("backends", "message"),
    [
        ("torch,foo", "unknown backend 'foo'; choose from torch,"),
        ("onnxruntime:fp64", "'onnxruntime:fp64': only onnxruntime and tensorrt take a precision"),
    ],
)
def test_bench_refuses_an_unknown_backend_as_a_usage_error(backends, message):
    assert message in usage_error_before_loading("bench", "--backends", backends)


def test_pipeline_inputs_match_diffusers_signatures():
    """pipeline_inputs reads a class's inputs from its name; each class's __call__ must agree."""
    import inspect

    import diffusers

    from sdtrt.core.families import PIPELINE_TASKS, pipeline_inputs

    for name in (name for row in PIPELINE_TASKS for name in row.values()):
        parameters = inspect.signature(getattr(diffusers, name).__call__).parameters
        optional = ("negative_prompt", "image", "mask_image", "control_image", "image_reference", "strength", "height")
        expected = {p for p in optional if p in parameters}
        assert pipeline_inputs(name) == expected, name


def test_a_prompt_longer_than_clip_reads_is_noted_once(tmp_path):
    """The pipelines cut a prompt to CLIP's 77 tokens; diffusers' warning is quieted with its logs, so sdtrt says so."""
    from transformers import CLIPTokenizer

    from sdtrt.sources.models import resolve_model

    prompt = "a lighthouse on a cliff at dusk, " * 12
    count = len(CLIPTokenizer.from_pretrained(resolve_model("tiny-sdxl").path / "tokenizer")(prompt).input_ids)
    args = ["generate", "--model", "tiny-sdxl", "--steps", "1", "--out", str(tmp_path / "x.png"), "--prompt"]
    notes = [line for line in run_cli(*args, prompt, check=True).stderr.splitlines() if "CLIP reads" in line]
    assert notes == [
        f"! the prompt {prompt[:30]!r}… is {count} CLIP tokens and CLIP reads 77: text_encoder and text_encoder_2 see "
        "only its first 77"
    ]
    assert "CLIP reads" not in run_cli(*args, "a lighthouse", check=True).stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "--model", "no-such-preset"], "is not a preset"),
        (["generate", "--model", "/no/such/folder"], "is not a preset"),
        (["export", "--model", "{tmp}"], "is not a diffusers model"),
    ],
)
def test_a_model_that_is_not_there_is_a_usage_error(tmp_path, args, message):
    """As an --engine that names no artifact is (exit 2), before anything is written."""
    engines = tmp_path / "engines"
    error = usage_error_before_loading(*[a.format(tmp=tmp_path) for a in args], "--engines", str(engines))
    assert message in error and Store(engines).artifacts() == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ls", "--engines", "README.md"], "engines path 'README.md' is a file, not a directory"),
        (["ls", "--engines", "{tmp}/none"], "engines directory '{tmp}/none' does not exist; pass --engines DIR"),
        (["verify", "--engines", "{tmp}/none"], "engines directory '{tmp}/none' does not exist"),
        (["gc", "--engines", "{tmp}/none"], "engines directory '{tmp}/none' does not exist"),
        (["gc", "--older-than", "-1", "--engines", "{tmp}"], "--older-than -1.0: a number of days must be 0 or more"),
    ],
)
def test_cache_commands_refuse_a_store_that_is_not_there_and_a_negative_age(tmp_path, args, message):
    """Not "0 artifacts", as if the store were empty; a negative age would list every artifact, as 0 does."""
    error = usage_error_before_loading("cache", *[a.format(tmp=tmp_path) for a in args])
    assert message.format(tmp=tmp_path) in error


@pytest.mark.parametrize(
    ("option", "example"), [("--batch", "batch 'abc' is not N or MIN:OPT:MAX (e.g. 1:2:4)"), ("--height", "(e.g. 256")]
)
def test_a_malformed_range_gives_an_example_of_its_own_kind(option, example):
    """A batch example for --batch (it gave pixels), pixels for --height."""
    result = run_cli("compile", option, "abc")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and example in result.stderr, result.stderr


def test_a_random_lora_file_follows_the_umask(tiny, tmp_path):
    """As the store's artifacts do: diffusers writes it 0600 (a temporary file), which another account cannot read."""
    import stat

    from sdtrt.lora.files import random_lora

    mask = os.umask(0o022)
    try:
        path = random_lora(tiny, tmp_path / "random.safetensors", rank=2)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_ctrl_c_during_generate_says_what_generate_left(tmp_path):
    """Not compile's note about stages, which generate does not build."""
    import signal
    import time

    out = tmp_path / "x.png"
    args = [sys.executable, "-m", "sdtrt", "generate", "--steps", "1", "--out", str(out)]
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as test_cli's interrupted export explains
    )  # fmt: skip
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and "libtorch" not in maps.read_text():
        time.sleep(0.05)  # until the command loads the pipeline: torch comes with it
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-500:]
    assert err.decode().strip().splitlines()[-1] == "interrupted: generate stopped before writing its results"
    assert not out.exists()


def test_one_text_encoder_engine_says_the_rest_runs_on_pytorch(tiny, store, capsys):
    """As an engine set lacking members does: an engine of one component leaves the others on PyTorch."""
    from sdtrt.pipeline.loading import load_pipeline
    from sdtrt.tools.compile import compile_model

    engine = compile_model(tiny, store, "onnxruntime", components=("text_encoder",)).final
    capsys.readouterr()
    load_pipeline(tiny, engine)
    assert "on PyTorch (not in the text_encoder engine): unet, vae_decoder, vae_encoder" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--image", "{tmp}/none.png"], "--image {tmp}/none.png does not exist; pass an image"),
        (["--mask", "{tmp}"], "--mask {tmp} is a directory; pass an image"),
        (["--image", "README.md"], "--image: cannot read README.md as an image"),
    ],
)
def test_an_image_that_is_not_there_is_one_line_as_one_that_is_not_an_image(tmp_path, args, message):
    """sdtrt's one line for each, not Typer's box for a missing file beside sdtrt's line for an unreadable one."""
    error = usage_error_before_loading("generate", *[a.format(tmp=tmp_path) for a in args])
    assert message.format(tmp=tmp_path) in error


def test_help_shows_no_value_for_flags_and_the_choices_of_string_options():
    """A flag takes no value (`--static true` is refused): none is shown. --task, --level, --scheduler list theirs."""
    compile_help = run_cli("compile", "--help", check=True).stdout
    generate_help = run_cli("generate", "--help", check=True).stdout
    assert "<bool>" not in compile_help + generate_help
    static = next(line for line in compile_help.splitlines() if "--static" in line)
    assert static.split("--static")[1].split()[0] == "TensorRT:", static
    assert "--level" in compile_help and "<1|2|2.5|3|4>" in compile_help
    assert "<txt2img|img2img|inpaint>" in generate_help and "<FILE[:SCALE]>" in generate_help
    assert "<pndm|ddim|euler|" in generate_help


def test_an_sd35_lora_on_flux_is_refused_as_an_sd3_lora(tmp_path):
    """Before its weights are mapped, as a Flux LoRA on SD3 is: SD3.5's attn2 is in no Flux block (a UNet's attn2 is
    under unet.)."""
    import torch
    from safetensors.torch import save_file

    from sdtrt.core.errors import LoraError
    from sdtrt.lora.files import read_lora
    from sdtrt.lora.kinds import named_kinds

    key = "transformer.transformer_blocks.0.attn2.to_k"
    save_file({f"{key}.lora_A.weight": torch.ones(4, 64), f"{key}.lora_B.weight": torch.ones(64, 4)}, tmp_path / "a.st")
    with pytest.raises(LoraError, match=rf"is an? SD3 LoRA \('{key}.lora_A.weight'\); this model \(flux\) takes FLUX"):
        read_lora(tmp_path / "a.st", "flux")
    assert named_kinds(["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.lora_A.weight"])[0] == {"unet"}


def test_clip_layers_of_another_familys_lora_on_flux_are_not_called_t5(tmp_path):
    """An SD3 LoRA's CLIP-G layers (text_encoder_2.text_model…) on Flux, whose text_encoder_2 is T5."""
    import torch
    from safetensors.torch import save_file

    from sdtrt.core.errors import LoraError
    from sdtrt.lora.files import read_lora

    key = "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.ones(4, 64), f"{key}.lora_B.weight": torch.ones(64, 4)}, tmp_path / "a.st")
    with pytest.raises(LoraError, match=r"to \(a CLIP encoder's weight: a LoRA for another model \(SD3, SDXL\)\?\)"):
        read_lora(tmp_path / "a.st", "flux")


class _Tokenizer:
    """A tokenizer that reads one token per word (what check_t5_prompts and clip_cuts count), of a fixed length."""

    def __init__(self, model_max_length: int = 77) -> None:
        self.model_max_length = model_max_length

    def __call__(self, prompt: str):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=prompt.split())


def test_a_size_suggested_for_an_engine_is_one_its_profile_takes():
    """Trial 8: `debug --height 100` on a 128..384 px engine suggested 96, which that engine then refused."""
    from sdtrt.core.config import Range, ShapeProfile
    from sdtrt.core.errors import RequestError
    from sdtrt.pipeline.request import check_size

    profile = ShapeProfile(height=Range(128, 256, 384), width=Range(128, 256, 384))
    for height, suggested in ((100, 128), (7, 128), (250, 256), (1000, 384)):
        with pytest.raises(RequestError, match=rf"use e\.g\. {suggested}$"):
            check_size(height, None, 16, profile)
    with pytest.raises(RequestError, match=r"use e\.g\. 96$"):  # no engines: the nearest on the grid
        check_size(100, None, 16, None)


def test_a_t5_prompt_no_pipeline_takes_is_not_told_to_rebuild():
    """Trial 8: a 541-token prompt was told to rebuild with --tokens 32:256:512, which cannot cover it."""
    from sdtrt.core.errors import RequestError
    from sdtrt.pipeline.token_limits import check_t5_prompts

    with pytest.raises(RequestError, match=r"more than the 256 the engines were built for; shorten it, or rebuild"):
        check_t5_prompts(["word " * 300], _Tokenizer(), 256, built=True)
    with pytest.raises(RequestError, match=r"more than the 512 the engines were built for; shorten it$"):
        check_t5_prompts(["word " * 541], _Tokenizer(), 512, built=True)


def test_a_cut_prompt_line_agrees_with_its_encoders():
    from sdtrt.pipeline.request import clip_cuts

    long = "word " * 100
    assert "text_encoder sees only its first 77" in clip_cuts([long], {"text_encoder": _Tokenizer()})[0]
    both = {"text_encoder": _Tokenizer(), "text_encoder_2": _Tokenizer()}
    assert "text_encoder and text_encoder_2 see only its first 77" in clip_cuts([long], both)[0]


def test_an_out_that_is_a_folder_is_named_as_one(tmp_path):
    """Trial 8: `generate --out <an existing folder>` was refused for having no extension."""
    from sdtrt.cli.result_files import ensure_image_file
    from sdtrt.core.errors import RequestError

    with pytest.raises(RequestError, match=r"is a folder; name a \.png"):
        ensure_image_file(tmp_path, "--out")
