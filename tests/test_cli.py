"""The CLI as a user meets it: output contract, cache hits, one-line errors, nothing half-written."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdtrt import __version__
from sdtrt.core.artifact import MANIFEST
from sdtrt.core.errors import one_line
from sdtrt.core.store import TMP_DIR, Store

from .helpers import REPO, last_line, private_store, run_cli


def test_compile_twice_second_run_is_a_cache_hit(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("auto picks TensorRT on a GPU machine")
    engines = tmp_path / "engines"
    started = time.perf_counter()
    first = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", "--engines", str(engines), check=True)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    # On a machine without a GPU, auto means ONNX Runtime: the same artifacts, all cache hits.
    second = run_cli(
        "compile", "--model", "tiny", "--target", "auto", "--no-validate", "--engines", str(engines), check=True
    )
    second_s = time.perf_counter() - started
    print(f"compile tiny: first {first_s:.1f} s, cached {second_s:.1f} s")
    artifact_dir = Path(last_line(first.stdout))
    assert (artifact_dir / MANIFEST).is_file()
    assert last_line(second.stdout) == str(artifact_dir)
    assert "Exporting UNet" in first.stderr and "Exporting UNet" not in second.stderr
    for stage in ("export", "simplify", "build-ort", "set"):
        assert f"{stage}: cached" in second.stderr and f"{stage}: cached" not in first.stderr
    for component in ("unet", "text_encoder", "vae_decoder", "vae_encoder"):  # which network each hit is
        assert second.stderr.count(f"export: cached {component} ") == 1, second.stderr
    assert "Total" in first.stderr and "Total" not in second.stderr, "op tables for what ran, not for cache hits"
    assert "onnxruntime: requested" in first.stderr
    assert "engine vs PyTorch fp32" in first.stderr, "compile validates by default"
    assert "no CUDA GPU is visible to torch, so the ONNX Runtime target was chosen" in second.stderr
    stages = sorted(a.stage for a in Store(engines).artifacts())
    assert stages == ["build-ort"] * 4 + ["export"] * 4 + ["set"] + ["simplify"] * 4 + ["validate"], (
        "every component, one set, its validation report"
    )
    assert artifact_dir.parent.name == "set"


def test_stage_commands_chain_through_printed_paths(tmp_path, tiny_export):
    result = run_cli("simplify", str(tiny_export.primary), "--engines", str(tmp_path), check=True)
    simplified = Path(last_line(result.stdout))
    assert simplified.parent.name == "simplify" and (simplified / "unet.sim.onnx").is_file()
    ls = run_cli("cache", "ls", "--engines", str(tmp_path), check=True)
    assert "1 artifacts" in ls.stdout
    rows = [line for line in ls.stdout.splitlines() if line.startswith("simplify ")]
    assert len(rows) == 1 and rows[0].endswith(str(simplified)), "one artifact a line on stdout, for grep"
    assert "1 artifacts verified" in run_cli("cache", "verify", "--engines", str(tmp_path), check=True).stdout


@pytest.mark.parametrize(
    "command",
    ["export", "simplify", "build", "wrap", "compile", "generate", "validate", "bench", "profile", "report", "cache"],
)
def test_help_explains_with_an_example(command):
    result = run_cli(command, "--help", check=True)
    assert "Example" in result.stdout or "ls" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simplify", "{tmp}/corrupt.onnx"], "is not a readable ONNX model"),
        (["simplify", "{tmp}/missing.onnx"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_1(tmp_path, args, message):
    (tmp_path / "corrupt.onnx").write_bytes(b"garbage")
    engines = tmp_path / "engines"
    result = run_cli(*[a.format(tmp=tmp_path) for a in args], "--engines", str(engines))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("error:") and message in result.stderr
    assert Store(engines).artifacts() == []


def test_tensorrt_target_without_gpu_fails_fast(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    result = run_cli("compile", "--target", "tensorrt", "--engines", str(tmp_path))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0
    assert "no CUDA GPU" in result.stderr and "docker" in result.stderr
    assert Store(tmp_path).artifacts() == [], "it stops before exporting anything"


def test_usage_errors_exit_2():
    assert run_cli("export", "--precision", "fp8").returncode == 2
    assert run_cli("no-such-command").returncode == 2


def test_debug_env_shows_the_traceback():
    result = run_cli("export", "--model", "no-such-preset", env={"SDTRT_DEBUG": "1"})
    assert result.returncode == 1 and "Traceback" in result.stderr and "ModelNotFoundError" in result.stderr


def _without_dac_override() -> list[str]:
    """Root ignores permission bits; drop that capability so a read-only folder is read-only."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: cannot make a folder read-only for this process")
    return [
        "setpriv",
        "--inh-caps=-dac_override,-dac_read_search",
        "--bounding-set=-dac_override,-dac_read_search",
        "--",
    ]


def test_read_only_engines_directory(tmp_path):
    engines = tmp_path / "engines"
    engines.mkdir()
    engines.chmod(0o555)
    try:
        result = subprocess.run(
            [*_without_dac_override(), sys.executable, "-m", "sdtrt", "export", "--engines", str(engines)],
            capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
    finally:
        engines.chmod(0o755)
    assert result.returncode == 1
    assert "is not writable" in result.stderr and "--engines" in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert list(engines.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_interrupted_export_leaves_nothing_complete(tmp_path, sig):
    engines = tmp_path / "engines"
    args = [sys.executable, "-m", "sdtrt", "export", "--precision", "fp32", "--engines", str(engines)]
    # SIGINT as a terminal's Ctrl-C delivers it: a shell running the tests in the background (CI scripts, `&`)
    # starts them with SIGINT ignored, which every child inherits, and an ignored SIGINT never interrupts.
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline and not any((engines / TMP_DIR).glob("export-*")):
        time.sleep(0.05)
    assert proc.poll() is None, "export finished before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    store = Store(engines)
    assert store.artifacts() == [], f"rc {proc.returncode}: {err.decode()[-500:]}"
    leftovers = list((engines / TMP_DIR).iterdir())
    if sig == signal.SIGINT:
        assert leftovers == [], "Ctrl-C cleans up its own temp directory"
        assert proc.returncode == 130, err.decode()[-500:]
        assert err.decode().strip().endswith("stages that finished stay cached for the next run")
    assert sorted(store.gc().removed) == sorted(leftovers)
    # The store completes the same export now (in this process: another CLI start costs seconds, proves no more).
    from sdtrt.core.config import ExportConfig
    from sdtrt.sources.models import resolve_model
    from sdtrt.stages import export

    rerun = export.run(ExportConfig(precision="fp32"), resolve_model("tiny"), store)
    assert (rerun.path / MANIFEST).is_file() and rerun.path.parent == engines / "export"


@pytest.mark.parametrize(
    ("command", "out", "message"),
    [
        ("generate", "noext", "--out {out}: it has no extension; name a .png"),
        ("generate", "image.xyz", "'.xyz' is not an image format Pillow writes"),
        ("generate", "ro/image.png", "--out {out}: its folder {tmp}/ro is not writable; pass another path"),
        ("profile", "ro/prof", "--out {out}: its folder {tmp}/ro is not writable; pass another path"),
        ("profile", "file/prof", "--out {out}: {tmp}/file is a file, not a folder"),
        ("client", "ro/image.png", "its folder {tmp}/ro is not writable"),
    ],
)
def test_an_out_that_cannot_be_written_is_refused_before_any_work(tmp_path, command, out, message):
    """generate's and client's image and profile's folder are written after the whole run: what cannot be written is a
    usage error before anything loads, as --json's folder is (they ended in 'unexpected ValueError/OSError')."""
    (tmp_path / "ro").mkdir(mode=0o555)
    (tmp_path / "file").write_text("a file, where a results folder is asked for")
    path = tmp_path / out
    url = ["--url", "127.0.0.1:9"] if command == "client" else []  # nothing listens: reaching it would fail otherwise
    try:
        result = subprocess.run(
            [*_without_dac_override(), sys.executable, "-m", "sdtrt", command, "--steps", "1", "--out", str(path),
             *url],
            capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=600,
            env=os.environ | {"SDTRT_DEBUG": "0"},
        )  # fmt: skip
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and message.format(out=path, tmp=tmp_path) in result.stderr
    assert not path.exists() and list((tmp_path / "ro").iterdir()) == []


def test_version_and_help_do_not_import_the_heavy_libraries():
    assert run_cli("--version", check=True).stdout.strip() == f"sdtrt {__version__}"
    heavy = "('torch', 'diffusers', 'transformers', 'onnx')"
    code = f"import sys, sdtrt.cli; print(sorted(m for m in {heavy} if m in sys.modules))"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert imported.stdout.strip() == "[]", "`sdtrt --help` and `cache` must start without torch, diffusers, onnx"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--height", "7"], "height 7 is not a positive multiple of 16 pixels"),
        (["generate", "--height", "-64"], "height -64 is not a positive multiple of 16 pixels"),
        (["generate", "--height", "300", "--width", "256"], "height 300 is not a positive multiple of 16 pixels"),
        (["generate", "--width", "100"], "width 100 is not a positive multiple of 16 pixels"),
        (
            ["generate", "--seed", "99999999999999999999"],
            "seed 99999999999999999999 is outside 0..18446744073709551615",
        ),
        (["generate", "--seed", "-1"], "seed -1 is outside 0..18446744073709551615"),
        (["generate", "--scheduler", "nope"], "scheduler 'nope' is not one of pndm"),
        (
            ["generate", "--model", "tiny-flux", "--height", "136"],
            "height 136 is not a positive multiple of 16 pixels, which this model's denoiser (its UNet or transformer) "
            "and VAE need; use e.g. 128",
        ),
        (
            ["generate", "--model", "tiny-flux", "--prompt", "astronaut " * 600],
            "T5 tokens, more than the 512 the pipeline takes (max_sequence_length); shorten it",
        ),
        (["generate", "--scheduler", "flow-euler"], "scheduler 'flow-euler' cannot drive a UNet model of family sd1"),
        (
            ["generate", "--model", "tiny-sd3", "--scheduler", "euler"],
            "scheduler 'euler' cannot drive a flow-matching (SD3 / Flux) model of family sd3; use one of flow-euler, "
            "flow-heun",
        ),
        (
            ["validate", "--model", "tiny-flux", "--engine", "0123abcd", "--scheduler", "flow-heun"],
            "scheduler 'flow-heun' cannot drive a flow-matching (SD3 / Flux) model of family flux; use one of "
            "flow-euler",
        ),
        (
            ["validate", "--model", "tiny", "--engine", "0123abcd", "--height", "300"],
            "height 300 is not a positive multiple of 16",
        ),
        (["generate", "--task", "inpaint"], "--task inpaint needs an input image: pass --image"),
        (
            ["generate", "--model", "tiny-flux", "--negative-prompt", "blurry"],
            "FLUX.1 pipelines read one only for true",
        ),
        (["compile", "--model", "tiny", "--tokens", "64"], "this model has no T5"),
        # export's --component in compile's words (it called a network it lists unknown, or showed the cache path)
        (
            ["export", "--model", "tiny-flux", "--component", "text_encoder_3"],
            "model 'tiny-flux' has no text_encoder_3 (it has transformer, text_encoder, text_encoder_2, vae_decoder",
        ),
        (["export", "--model", "tiny", "--component", "transformer"], "model 'tiny' has no transformer (it has unet,"),
        (
            ["compile", "--model", "tiny-sdxl", "--components", "text_encoder_3"],
            "model 'tiny-sdxl' has no text_encoder_3",
        ),
        (["profile", "--out", "{tmp}/prof", "--width", "8"], "width 8 is not a positive multiple of 16"),
        (["bench", "--height", "300"], "height 300 is not a positive multiple of 16"),
        (["compile", "--height", "100"], "height 100 is not a positive multiple of 16 pixels"),
        (["compile", "--batch", "4:1:2"], "batch range 4:1:2 must satisfy 0 < min <= opt <= max"),
        (["compile", "--batch", "1:1:1000000"], "batch range 1:1:1000000: at most 64 images per prompt"),
        (  # FluxPipeline's check_inputs refuses more: every generate on such a set failed
            ["compile", "--model", "tiny-flux", "--tokens", "32:64:1024"],
            "tokens range 32:64:1024: SD3 and FLUX.1 pipelines take at most 512 T5 tokens",
        ),
        (["compile", "--model", "tiny-sd3", "--tokens", "600"], "take at most 512 T5 tokens (max_sequence_length)"),
        (
            ["validate", "--model", "tiny", "--engine", "0123abcd", "--min-cosine", "2"],
            "minimum cosine 2.0 is outside -1..1",
        ),
        (["bench", "--json", "{tmp}/file/b.json"], "--json {tmp}/file/b.json: cannot make its folder"),
        (["generate", "--lora", "{tmp}/missing.safetensors"], "LoRA file {tmp}/missing.safetensors does not exist"),
        (["bench", "--lora", "{tmp}/file:abc"], "'abc' is not a scale"),
        (["compile", "--revalidate", "--no-validate"], "--revalidate asks for a validation that --no-validate"),
        (["compile", "--calibration-steps", "2"], "--calibration-steps configures the quantization of --precision"),
        (["debug", "0123abcd", "--max-error", "-1"], "--max-error -1.0: a normalised error limit must be above 0"),
    ],
)
def test_requests_no_model_can_serve_are_usage_errors_before_any_work(tmp_path, args, message):
    engines, out = tmp_path / "engines", tmp_path / "image.png"
    (tmp_path / "file").write_text("a file, where a results folder is asked for")
    if args[0] == "generate":
        args = [*args, "--out", str(out)]
    result = run_cli(*[a.format(tmp=tmp_path) for a in args], "--engines", str(engines))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error:") and result.stderr.strip().count("\n") == 0, result.stderr
    assert message.format(tmp=tmp_path) in result.stderr
    assert not out.exists() and not (tmp_path / "prof").exists() and Store(engines).artifacts() == []


def test_validate_refuses_a_size_outside_the_engines_profile_in_pixels(tiny_engine):
    result = run_cli("validate", "--engine", str(tiny_engine.path), "--height", "1024")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "height 1024 is outside the engine's profile (128..384 px)" in result.stderr


@pytest.mark.parametrize("command", ["generate", "profile"])
def test_generate_and_profile_refuse_a_size_outside_the_engines_profile_before_loading(tiny_engine, tmp_path, command):
    out = tmp_path / ("x.png" if command == "generate" else "x")  # an image file, a folder
    result = run_cli(command, "--engine", str(tiny_engine.path), "--height", "1024", "--out", str(out))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "height 1024 is outside the engine's profile (128..384 px)" in result.stderr
    assert not out.exists()


def test_results_go_into_folders_that_do_not_exist_yet(tmp_path, tiny_engine):
    out = tmp_path / "new" / "deeper"
    bench = run_cli(
        "bench", "--backends", "torch", "--steps", "1", "--warmup", "0", "--repeats", "1", "--height", "128",
        "--width", "128", "--json", str(out / "b.json"), "--time-file", str(out / "t.txt"),
        "--chart", str(out / "c.png"), "--engines", str(tmp_path / "engines"),
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert {p.name for p in out.iterdir()} == {"b.json", "t.txt", "c.png"}
    # validate --json into a new folder: tests/test_validate.py::test_cli_validate_and_generate_with_the_engine
    debugged = run_cli("debug", str(tiny_engine.path), "--json", str(tmp_path / "d" / "d.json"))
    assert debugged.returncode in (0, 3) and (tmp_path / "d" / "d.json").is_file(), debugged.stderr


def test_a_corrupt_engine_is_refused_on_load_and_rebuilt_by_compile(tmp_path, tiny_engine):
    engines = private_store(tiny_engine, tmp_path / "engines")  # corrupted below: a copy of the session's engine
    compile_args = (
        "compile",
        "--target",
        "onnxruntime",
        "--components",
        "unet",
        "--no-validate",
        "--engines",
        str(engines),
    )
    artifact = engines / tiny_engine.stage / tiny_engine.path.name  # what compile_args print: the rebuild says so
    onnx_file = artifact / "unet.ort.onnx"
    size = onnx_file.stat().st_size
    with onnx_file.open("r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "image.png"
    refused = run_cli("generate", "--engine", str(artifact), "--steps", "1", "--out", str(out))
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert f"artifact {artifact} is corrupt: unet.ort.onnx has {size // 2} bytes" in refused.stderr
    assert "rebuild it with `sdtrt build" in refused.stderr and not out.exists()

    rebuilt = run_cli(*compile_args, check=True)
    assert f"cached build-ort artifact {artifact} is corrupt" in rebuilt.stderr and "rebuilding" in rebuilt.stderr
    assert last_line(rebuilt.stdout) == str(artifact) and onnx_file.stat().st_size == size
    assert "1 artifacts verified" not in run_cli("cache", "verify", "--engines", str(engines), check=True).stdout

    # The engine by its key from `cache ls`, in the store --engines names, for every command that takes one.
    key = f"build-ort/{artifact.name[:8]}"
    made = run_cli("generate", "--engine", key, "--engines", str(engines), "--steps", "1", "--out", str(out),
                   check=True)  # fmt: skip
    assert out.is_file()
    # Off a terminal, the denoising bar is one timed line, and no blank line follows it.
    assert "✓ Denoising (1 step)" in made.stderr and "\n\n" not in made.stderr, made.stderr
    checked = run_cli("validate", "--engine", key, "--engines", str(engines), "--no-images", check=True)
    assert last_line(checked.stdout) == "parity: PASS" and "engine vs PyTorch fp32" in checked.stdout
    traced = run_cli(
        "profile", "--engine", key, "--engines", str(engines), "--steps", "1", "--out", str(tmp_path / "p")
    )
    assert traced.returncode == 0 and last_line(traced.stdout) == str(tmp_path / "p" / "trace.json")


def test_gc_on_a_read_only_store_reports_what_it_could_not_remove(tmp_path, tiny_export):
    engines = private_store(tiny_export, tmp_path / "engines")
    artifact = engines / "export" / tiny_export.path.name
    (engines / "export").chmod(0o555)
    try:
        result = subprocess.run(
            [*_without_dac_override(), sys.executable, "-m", "sdtrt", "cache", "gc", "--older-than", "0",
             "--engines", str(engines)],
            capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300,
        )  # fmt: skip
    finally:
        (engines / "export").chmod(0o755)
    assert result.returncode == 1 and "removed " + str(artifact) not in result.stdout
    assert "0 entries removed" in result.stdout
    assert result.stderr.startswith("error: 1 entries could not be removed") and result.stderr.count("\n") == 1
    assert (artifact / MANIFEST).is_file()


def test_an_unexpected_error_without_a_message_still_says_something():
    try:
        raise ImportError()
    except ImportError as exc:
        described = one_line(exc)
    assert described.startswith("no message, raised at") and "test_cli.py" in described


def test_messages_keep_their_colons_and_brackets():
    """rich would print ':abc:' as an emoji and eat '[tags]'; errors reach the user as written."""
    result = run_cli("generate", "--lora", "loraA:abc")
    assert result.returncode == 2 and "--lora loraA:abc: 'abc' is not a scale" in result.stderr, result.stderr
    assert "🔤" not in result.stderr
