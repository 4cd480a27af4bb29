"""Every command on the new families' tiny presets, as a user runs it (`sdtrt …`, run_cli): validate, bench,
profile, debug and check-blocks on the fp32 ONNX Runtime set, and generate with the images each task takes, its PNG
the image Python's generate() makes with the same engines (slow: each preset's set compiles once, 25-90 s of CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from .helpers import last_line, run_cli

pytestmark = pytest.mark.slow

# preset → (task, the image inputs it takes as generate's flags) per generate run, and the networks check-blocks
# checks (the transformer; where cheap the LLM text encoder).
RUNS = {
    "tiny-flux2-klein": [("txt2img", ("image",))],  # a reference image
    "tiny-zimage": [("img2img", ("image",)), ("inpaint", ("image", "mask"))],
    "tiny-qwen-image": [("img2img", ("image",)), ("inpaint", ("image", "mask"))],
    "tiny-qwen-image-edit": [("img2img", ("image",))],  # the image to edit
    "tiny-flux-kontext": [("img2img", ("image",))],  # the reference image
}
BLOCK_CHECKED = {"tiny-zimage": ("transformer", "text_encoder"), "tiny-qwen-image": ("transformer", "text_encoder")}
SIZE = (128, 192)  # height, width: not square; the Qwen-Image sets at 4x, inside their default profile (512..1536 px)
SIZES = {"tiny-qwen-image": (512, 768), "tiny-qwen-image-edit": (512, 768)}
PRESETS = list(RUNS)


def noise_picture(path, seed: int, size: tuple[int, int], mode: str = "RGB"):
    rng = np.random.default_rng(seed)
    if mode == "L":  # the right half repainted
        mask = np.zeros(size, np.uint8)
        mask[:, size[1] // 2 :] = 255
        Image.fromarray(mask, "L").save(path)
    else:
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(params=PRESETS)
def family(request, fp32_engine_sets):
    """(preset, its fp32 ONNX Runtime engine set)."""
    return request.param, fp32_engine_sets(request.param)


def member(engine_set, component: str):
    from sdtrt.stages.engine_set import engine_members

    return engine_members(engine_set)[component]


def test_validate_passes_and_writes_its_report(family, store, tmp_path):
    preset, engine_set = family
    report = tmp_path / "v.json"
    args = ["validate", "--engine", str(engine_set.path), "--steps", "2", "--json", str(report), "--no-report"]
    result = run_cli(*args, "--engines", str(store.root), env={"COLUMNS": "200"}, check=True)
    print(result.stdout)
    assert last_line(result.stdout).startswith("parity: PASS") and f"({preset})" in result.stdout
    data = json.loads(report.read_text())
    assert data["tensors"] and all(row["cosine"] > 0.9999 for row in data["tensors"])


def task_flags(preset: str, folder) -> tuple[str, tuple[str, ...], list[str]]:
    """The preset's first generate run as flags: (task, its image inputs, --task … --image … [--mask …] and the
    size)."""
    (task, inputs), size = RUNS[preset][0], SIZES.get(preset, SIZE)
    files = {"image": noise_picture(folder / "i.png", 1, size), "mask": noise_picture(folder / "m.png", 2, size, "L")}
    flags = ["--task", task, "--height", str(size[0]), "--width", str(size[1])]
    return task, inputs, flags + [f for name in inputs for f in (f"--{name}", str(files[name]))]


def test_bench_times_the_engine_set(family, store, tmp_path):
    """bench on the preset's task with its images (Qwen-Image-Edit's image to edit, Kontext's and klein's
    reference), as generate takes them."""
    preset, _ = family
    report_file = tmp_path / "b.json"
    task, inputs, flags = task_flags(preset, tmp_path)
    args = ["bench", "--model", preset, "--backends", "torch,onnxruntime:fp32", "--steps", "2", "--warmup", "0"]
    result = run_cli(*args, *flags, "--repeats", "1", "--json", str(report_file), "--engines", str(store.root),
                     env={"COLUMNS": "200"})  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_file.read_text())
    assert report["config"]["denoiser"] == "transformer" and "transformer/call ms" in result.stdout
    assert report["config"]["task"] == task and report["config"]["inputs"] == ["image"] == list(inputs)
    for run in report["backends"]:
        assert run["status"] == "ok", run["reason"]
        assert run["total_s"]["median"] > 0 and run["unet_calls"] >= 2 and run["peak_rss_mb"] > 0
        assert run["stages_s"]["unet"]["median"] <= run["stages_s"]["denoise_loop"]["median"]


def test_profile_writes_its_trace_and_step_table(family, store, tmp_path):
    """profile on the preset's task with its images; Z-Image's and Qwen-Image's inpainting with a --mask too."""
    preset, engine_set = family
    _, _, flags = task_flags(preset, tmp_path)
    if len(RUNS[preset]) > 1:  # inpaint: the mask as well
        flags = [*flags[:1], "inpaint", *flags[2:], "--mask", str(tmp_path / "m.png")]
    args = ["profile", "--engine", str(engine_set.path), "--steps", "2", "--out", str(tmp_path), *flags]
    result = run_cli(*args, "--engines", str(store.root), env={"COLUMNS": "200"}, check=True)
    print(result.stdout)
    assert last_line(result.stdout) == str(tmp_path / "trace.json") and "transformer ms" in result.stdout
    names = [e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert names.count("pipeline") == 1 and names.count("vae_decode") == 1 and names.count("unet") >= 2
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert len(steps) == 2 and all(0 < s["unet_seconds"] <= s["seconds"] for s in steps)
    assert json.loads((tmp_path / "flame.speedscope.json").read_text())["profiles"]


def test_debug_finds_no_divergent_layer_in_the_transformer(family, store, tmp_path):
    _, engine_set = family
    report_file = tmp_path / "d.json"
    transformer = member(engine_set, "transformer")
    result = run_cli("debug", str(transformer.path), "--json", str(report_file), "--engines", str(store.root),
                     check=True)  # fmt: skip
    print(result.stdout)
    report = json.loads(report_file.read_text())
    assert report["passed"] is True and report["compared"] > 100 and report["largest_error"] < 1e-3
    assert "no layer diverges" in result.stdout


@pytest.mark.parametrize("preset", list(BLOCK_CHECKED))
def test_check_blocks_passes_on_the_transformer_and_llm_encoder(preset, store, tmp_path):
    for component in BLOCK_CHECKED[preset]:
        exported = run_cli("export", "--model", preset, "--component", component, "--precision", "fp32",
                           "--exporter", "dynamo", "--engines", str(store.root), check=True)  # fmt: skip
        report_file = tmp_path / f"{component}.json"
        args = ["check-blocks", "--engine", last_line(exported.stdout), "--json", str(report_file)]
        result = run_cli(*args, "--engines", str(store.root), env={"COLUMNS": "200"}, check=True)
        print(result.stdout)
        report = json.loads(report_file.read_text())
        assert report["passed"] is True and len(report["blocks"]) >= 2, report["failures"]
        for row in report["blocks"]:
            assert row["outputs"] and all(out["cosine"] >= 0.9999 for out in row["outputs"]), row


def test_generate_with_the_tasks_images_is_pythons_image(family, store, tmp_path):
    """The PNG `sdtrt generate --image/--mask` writes is the image generate() makes in Python with the same engines
    and request, and both are the PyTorch fp32 pipeline's within 35 dB."""
    from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
    from sdtrt.sources.models import resolve_model
    from sdtrt.tools.image_quality import psnr_db

    preset, engine_set = family
    source, size = resolve_model(preset), SIZES.get(preset, SIZE)
    edit = preset == "tiny-qwen-image-edit"  # guides only with a negative prompt
    for task, inputs in RUNS[preset]:
        files = {"image": noise_picture(tmp_path / "i.png", 1, size)}
        files["mask"] = noise_picture(tmp_path / "m.png", 2, size, "L")
        out = tmp_path / f"{task}.png"
        flags = [f for name in inputs for f in (f"--{name}", str(files[name]))]
        flags += ["--negative-prompt", " ", "--guidance", "4"] if edit else []
        args = ["generate", "--engine", str(engine_set.path), "--task", task, "--prompt", "a red fox", "--steps", "2"]
        args += ["--seed", "3", "--height", str(size[0]), "--width", str(size[1]), "--out", str(out), *flags]
        run_cli(*args, "--engines", str(store.root), check=True)
        request = GenerateRequest(
            "a red fox", " " if edit else None, 2, 4.0 if edit else None, 3, *size,
            image=Image.open(files["image"]).convert("RGB"),
            mask_image=Image.open(files["mask"]).convert("L") if "mask" in inputs else None,
        )  # fmt: skip
        engine, reference = (load_pipeline(source, artifact, task=task) for artifact in (engine_set, None))
        want = np.asarray(generate(engine, request).images[0])
        torch_image = np.asarray(generate(reference, request).images[0], np.float32) / 255
        got = np.asarray(Image.open(out).convert("RGB"))
        psnr = psnr_db(got.astype(np.float32) / 255, torch_image)
        print(f"{preset} {task} {size[0]}x{size[1]}: CLI == Python {np.array_equal(got, want)}, {psnr:.1f} dB")
        assert got.shape == (*size, 3) and got.std() > 2
        assert np.array_equal(got, want) and psnr >= 35.0


# preset → the served rows' tasks and what each carries besides prompt, steps, seed and size (images on the wire).
SERVED = {
    "tiny-qwen-image": {"img2img": ("image",), "inpaint": ("image", "mask_image")},
    "tiny-zimage": {"img2img": ("image",)},
    "tiny-qwen-image-edit": {"img2img": ("image",)},  # the image to edit; guided with a negative prompt
}


@pytest.mark.parametrize("preset", list(SERVED))
def test_the_triton_model_serves_generates_image_with_the_image_on_the_wire(preset, fp32_engine_sets, tmp_path):
    """`sdtrt deploy triton`'s model (its execute run here, tests/triton_backend.py) picks each row's task from the
    images it carries and answers with the image generate() gives for the same request."""
    from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
    from sdtrt.sources.models import resolve_model

    from . import triton_backend

    engine_set, size = fp32_engine_sets(preset), SIZES.get(preset, SIZE)
    rng = np.random.default_rng(5)
    pixels = {"image": rng.integers(0, 256, (*size, 3), dtype=np.uint8), "mask_image": np.zeros(size, np.uint8)}
    pixels["mask_image"][:, size[1] // 2 :] = 255
    edit = {"negative_prompt": " ", "guidance": 4.0} if preset == "tiny-qwen-image-edit" else {}
    numbers = {"steps": 2, "height": size[0], "width": size[1]}
    rows = {task: ({"seed": i} | numbers | edit | {n: pixels[n] for n in names})
            for i, (task, names) in enumerate(SERVED[preset].items())}  # fmt: skip
    with triton_backend.served(engine_set, tmp_path) as model:
        responses = model.execute([triton_backend.row(f"a fox {task}", **given) for task, given in rows.items()])
    source = resolve_model(preset)
    for (task, given), response in zip(rows.items(), responses, strict=True):
        assert response.error is None, response.error.message()
        images = {"image": Image.fromarray(given.pop("image"))}
        if "mask_image" in given:
            images["mask_image"] = Image.fromarray(given.pop("mask_image"), "L")
        request = GenerateRequest(prompt=f"a fox {task}", **given, **images)
        expected = np.asarray(generate(load_pipeline(source, engine_set, task=task), request).images[0])
        print(f"{preset} {task}: served image {response.image().shape}, equal to generate()'s")
        np.testing.assert_array_equal(response.image()[0], expected, err_msg=task)


def test_sdtrt_client_sends_an_image_to_sdtrt_serve(fp32_engine_sets, store, tmp_path):
    """Z-Image's set as a user serves it: `sdtrt deploy triton`, `sdtrt serve` (a real Triton) and `sdtrt client
    --image`, whose image picks img2img on the server; the PNG it writes is generate()'s image."""
    import signal

    from sdtrt.pipeline.loading import GenerateRequest, generate, load_pipeline
    from sdtrt.sources.models import resolve_model

    from .test_serve import _serve_cli, wait_serving  # skipped without the serve extra

    engine_set = fp32_engine_sets("tiny-zimage")
    repository, log, out = tmp_path / "repo", tmp_path / "serve.log", tmp_path / "fox.png"
    run_cli("deploy", "triton", "--engine", str(engine_set.path), "--engines", str(store.root), "--out",
            str(repository), "--max-batch", "1", check=True)  # fmt: skip
    picture = noise_picture(tmp_path / "i.png", 1, SIZE)
    serve, url = _serve_cli(repository, log)
    try:
        wait_serving(serve, log)
        args = ["client", "--url", url, "--prompt", "a red fox", "--steps", "2", "--seed", "3", "--height"]
        run_cli(*args, str(SIZE[0]), "--width", str(SIZE[1]), "--image", str(picture), "--out", str(out), check=True)
    finally:
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(120)
    assert code == 0, log.read_text()[-2000:]
    request = GenerateRequest("a red fox", steps=2, seed=3, height=SIZE[0], width=SIZE[1],
                              image=Image.open(picture).convert("RGB"))  # fmt: skip
    pipe = load_pipeline(resolve_model("tiny-zimage"), engine_set, task="img2img")
    expected = np.asarray(generate(pipe, request).images[0])
    got = np.asarray(Image.open(out).convert("RGB"))
    print(f"tiny-zimage img2img via sdtrt serve: {got.shape}, equal to generate()'s {np.array_equal(got, expected)}")
    np.testing.assert_array_equal(got, expected)
