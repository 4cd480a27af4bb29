"""`sdtrt report`: one self-contained HTML page per engine set, opened in a real browser (Debian's Chromium, headless,
driven by Playwright): every section renders with no console error and no request off the file, the images decode,
and the numbers shown are the JSON's. Screenshots are kept under test-artifacts/report/.

Without Chromium or Playwright the browser tests skip with the reason; under CI=true they fail instead.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from sdtrt.core.artifact import Artifact
from sdtrt.core.config import OrtBuildConfig, Range, ShapeProfile, ValidationConfig
from sdtrt.core.errors import RequestError
from sdtrt.pipeline.request import GenerateRequest
from sdtrt.stages import build_ort
from sdtrt.stages.engine_set import members
from sdtrt.tools.bench import BenchConfig, run_bench
from sdtrt.tools.debug import debug
from sdtrt.tools.profile import profile_generation
from sdtrt.tools.report import REPORT_HTML, ReportConfig, write_report
from sdtrt.tools.report_images import difference_map, load_images
from sdtrt.tools.validate import REPORT, validate

from .helpers import REPO, last_line, plant_fp16_overflow, run_cli

SHOTS = Path(os.environ.get("SDTRT_TEST_ARTIFACTS") or REPO / "test-artifacts") / "report"
SECTIONS = ("images", "drift", "parity", "precision", "debug", "time", "provenance")


# Engines for one size (128², one image): their validation cases are the smallest, so each is compared in seconds.
SMALL = ("--height", "128", "--width", "128", "--batch", "1")
SMALL_PROFILE = ShapeProfile(Range(1, 1, 1), Range(128, 128, 128), Range(128, 128, 128))


@pytest.fixture(scope="module")
def healthy(tiny, store, tmp_path_factory):
    """tiny's set as `sdtrt compile` builds and validates it (its report.html beside the stored JSON), then
    `sdtrt report` with what debug (the UNet), bench (ONNX Runtime) and profile wrote for it."""
    folder = tmp_path_factory.mktemp("healthy")
    compiled = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", *SMALL, check=True)
    engine_set = Artifact.open(last_line(compiled.stdout))
    stored = Path(compiled.stderr.split("report: ")[1].split()[0])
    unet = members(engine_set)["unet"]
    (folder / "debug.json").write_text(json.dumps({"unet": debug(unet).to_json()}))
    bench = run_bench(tiny, BenchConfig(backends=("onnxruntime",), steps=2, repeats=1), store)
    (folder / "bench.json").write_text(json.dumps(bench))
    request = GenerateRequest("a lighthouse", steps=3, height=128, width=128)
    profile_generation(tiny, engine_set, folder / "profile", request)
    out = folder / "report.html"
    args = ["--debug", str(folder / "debug.json"), "--bench", str(folder / "bench.json")]
    made = run_cli("report", str(engine_set.path), "--out", str(out), *args, "--profile", str(folder / "profile"))
    assert made.returncode == 0, made.stderr
    assert last_line(made.stdout) == str(out), "the page's path is the command's result"
    return {"out": out, "stored": stored, "folder": folder, "set": engine_set}


@pytest.fixture(scope="module")
def overflowing(tiny, tiny_simplified, store, healthy, tmp_path_factory):
    """The tiny fp16 UNet with its middle conv's weights at 60000, past fp16's range (as test_debug plants it), built
    for one size, validated with images (a failure) and debugged; its report is given the healthy set's passing
    validation first."""
    folder = tmp_path_factory.mktemp("overflow")
    planted = plant_fp16_overflow(tiny_simplified, folder / "unet.onnx")
    graph = Artifact.open(folder / "unet.onnx")
    engine = build_ort.run(OrtBuildConfig(SMALL_PROFILE), graph, store)
    failing = validate(tiny, engine, ValidationConfig(steps=2))
    (folder / "debug.json").write_text(json.dumps(debug(graph).to_json()))  # the graph's node names, unfused
    passing = healthy["stored"].parent / REPORT
    config = ReportConfig(folder / "report.html", validations=(passing,), debug=folder / "debug.json")
    return {"out": write_report(engine, None, config, [failing]), "planted": planted, "report": failing}


def test_compile_writes_the_report_beside_the_stored_json(healthy):
    stored = healthy["stored"]
    assert stored.name == REPORT_HTML and (stored.parent / REPORT).is_file()
    page = stored.read_text()
    assert 'id="images"' in page and "data:image/png;base64," in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), "nothing off the file"


def test_compile_writes_no_report_when_told_not_to(healthy):
    quiet = run_cli("compile", "--model", "tiny", "--target", "onnxruntime", *SMALL, "--no-report", check=True)
    assert "validate: cached report" in quiet.stderr and "report: " not in quiet.stderr


@pytest.mark.slow  # two compiles and a validation from the command line (~35 s): suite time
def test_revalidate_replaces_the_stored_validation_and_a_moved_store_reports_from_it(healthy, tmp_path):
    """The healthy set's artifacts copied into a store of their own: `compile --revalidate` there replaces the stored
    validation (which now names the engines there) and its page; the store moved, compile reads the cached
    validation and writes its page in the store where it now is."""
    first, moved = tmp_path / "first", tmp_path / "moved"
    stored = Artifact.open(healthy["stored"].parent)
    chain = [stored, healthy["set"]] + [
        made for member in members(healthy["set"]).values() for made in member.lineage()
    ]
    for artifact in chain:
        shutil.copytree(artifact.path, first / artifact.stage / artifact.path.name, dirs_exist_ok=True)
    args = ("compile", "--model", "tiny", "--target", "onnxruntime", *SMALL)
    copied = (first / "validate" / stored.path.name / "manifest.json").stat().st_ino
    again = run_cli(*args, "--engines", str(first), "--revalidate")
    assert again.returncode == 0, again.stderr
    page = first / "validate" / stored.path.name / REPORT_HTML
    assert "validate: cached report" not in again.stderr and f"report: {page}" in again.stderr
    assert (page.parent / "manifest.json").stat().st_ino != copied, "the stored validation is the new run's"
    assert Artifact.open(page.parent).file_problems() == [], "the page is beside the artifact, not in its files"
    first.rename(moved)
    cached = run_cli(*args, "--engines", str(moved))
    assert cached.returncode == 0, cached.stderr
    page = moved / "validate" / stored.path.name / REPORT_HTML
    assert "validate: cached report" in cached.stderr and f"report: {page}" in cached.stderr


def test_a_damaged_stored_validation_is_left_out_and_a_failed_report_is_one_warning(healthy, tmp_path, capsys):
    from sdtrt.core.store import Store
    from sdtrt.tools.report import write_report_or_warn
    from sdtrt.tools.report_data import stored_validations

    stored = healthy["stored"].parent
    copy = tmp_path / "store"
    shutil.copytree(stored, copy / "validate" / stored.name)
    png = copy / "validate" / stored.name / "engine.png"
    png.write_bytes(png.read_bytes()[:100])  # truncated: PIL would fail on it
    assert stored_validations(healthy["set"], Store(copy)) == []
    assert "left out the damaged validation" in capsys.readouterr().err
    assert len(stored_validations(healthy["set"], Store(stored.parent.parent))) == 1
    (tmp_path / "taken").mkdir()  # a folder where the page should go: writing fails
    assert write_report_or_warn(healthy["set"], None, ReportConfig(tmp_path / "taken")) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store", "taken"], "no partial page left behind"
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("! report not written: cannot write the report to") and "\n" not in warning


@pytest.mark.parametrize(
    ("option", "content", "said"),
    [
        ("debug", [1, 2], r"--debug .* holds a JSON list, not the dict the command writes"),
        ("bench", {"backends": [{"name": "x", "status": "ok", "stages_s": 3}]}, r"the report cannot read --bench"),
        ("validations", {"engine": "e"}, r"--validation .* is not a `sdtrt validate --json` report"),
    ],
)
def test_a_results_file_of_another_shape_is_a_request_error(tiny_engine, tmp_path, option, content, said):
    given = tmp_path / "given.json"
    given.write_text(json.dumps(content))
    config = ReportConfig(tmp_path / "r.html", **{option: (given,) if option == "validations" else given})
    with pytest.raises(RequestError, match=said):
        write_report(tiny_engine, None, config)


def test_a_results_file_that_cannot_be_read_is_named_with_its_option(tiny_engine, tmp_path):
    (tmp_path / "bench.json").write_text("{ not json")
    missing = ReportConfig(tmp_path / "r.html", debug=tmp_path / "none.json")
    with pytest.raises(RequestError, match=r"--debug .*none.json does not exist; pass the file the command wrote"):
        write_report(tiny_engine, None, missing)
    with pytest.raises(RequestError, match=r"--bench .*bench.json cannot be read as JSON"):
        write_report(tiny_engine, None, ReportConfig(tmp_path / "r.html", bench=tmp_path / "bench.json"))
    assert not (tmp_path / "r.html").exists(), "nothing is written before every file is read"


def test_the_failing_case_comes_first_with_its_layer(overflowing):
    page = overflowing["out"].read_text()
    assert overflowing["report"].failures, "the planted overflow fails validation"
    assert page.index('class="case failed"') < page.index('class="case passed"')
    assert overflowing["planted"].name in page.split('data-role="first-layer"')[1].split("</p>")[0]


# ---- in the browser -------------------------------------------------------------------------------------------------


def chromium() -> str | None:
    return os.environ.get("SDTRT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "Playwright is not installed (pip install -e '.[dev]')"
    else:
        missing = None if chromium() else "no Chromium here (apt-get install chromium, or set SDTRT_CHROMIUM)"
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the report's browser tests must run in CI: {missing}")
        pytest.skip(missing)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium())
        yield launched
        launched.close()


def open_page(browser, html: Path, scheme: str = "light"):
    """The page, with everything it logged as an error and every request it made off its own file."""
    page = browser.new_page(color_scheme=scheme, viewport={"width": 1200, "height": 900})
    problems: list[str] = []
    page.on("console", lambda message: problems.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("request", lambda r: None if r.url.startswith(("data:", html.as_uri())) else problems.append(r.url))
    page.goto(html.as_uri())
    return page, problems


def test_every_section_renders_in_a_browser_with_the_json_numbers(browser, healthy):
    SHOTS.mkdir(parents=True, exist_ok=True)
    for scheme in ("light", "dark"):
        page, problems = open_page(browser, healthy["out"], scheme)
        assert page.evaluate("[...document.querySelectorAll('main > section')].map(s => s.id)") == list(SECTIONS)
        sizes = page.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth])")
        assert sizes and all(done and width > 0 for done, width in sizes), sizes
        page.screenshot(path=str(SHOTS / f"healthy-{scheme}.png"), full_page=True)
        for section in SECTIONS:
            page.locator(f"#{section}").screenshot(path=str(SHOTS / f"section-{section}-{scheme}.png"))
        assert problems == []
    assert shown_numbers(page) == expected_numbers(healthy), "every number shown, in order, is the JSON's"
    slider = page.locator("input[data-flip]").first
    slider.focus()
    page.keyboard.press("End")  # the flip is a range input: the keyboard moves it
    assert page.locator(".flip").first.evaluate("e => e.style.getPropertyValue('--split')") == "100%"


def test_a_failing_validation_shows_its_case_difference_and_layer_in_a_browser(browser, overflowing):
    page, problems = open_page(browser, overflowing["out"])
    first_case = page.locator("article.case").first
    assert "case failed" in first_case.get_attribute("class")
    difference = first_case.locator("img[data-role=difference]")
    assert difference.evaluate("i => i.naturalWidth") > 0
    layer = page.locator("[data-role=first-layer]")
    assert overflowing["planted"].name in layer.inner_text()
    assert page.locator("#debug text.marker-label").count() == 1
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "failing.png"), full_page=True)
    assert problems == []


def shown_numbers(page) -> dict[str, list[tuple[float, str]]]:
    """Every number the page shows, in its order: key → (the value it was formatted from, the text shown)."""
    found: dict[str, list[tuple[float, str]]] = {}
    for key, value, text in page.evaluate(
        "[...document.querySelectorAll('.num')].map(n => [n.dataset.key, n.dataset.value, n.textContent])"
    ):
        found.setdefault(key, []).append((json.loads(value), text))
    return found


def expected_numbers(healthy) -> dict[str, list[tuple[float, str]]]:
    """What the healthy page must show, from the JSON files it was made from, row by row: key → (value, text)."""
    found: dict[str, list[tuple[float, str]]] = {}

    def add(key: str, value: float, spec: str, unit: str = "") -> None:
        found.setdefault(key, []).append((value, format(value, spec) + (f" {unit}" if unit else "")))

    stored = json.loads((healthy["stored"].parent / REPORT).read_text())
    image = stored["image"]
    add("psnr_db", image["psnr_db"], ".2f", "dB")
    add("ssim", image["ssim"], ".4f")
    for row in image["drift"]:
        add("drift_psnr_db", row["psnr_db"], ".2f")
        add("drift_cosine", row["cosine"], ".6f")
    for row in sorted(stored["tensors"], key=lambda row: not row["failures"]):
        add("cosine", row["cosine"], ".6f")
        add("max_abs", row["max_abs"], ".3g")
        add("mean_abs", row["mean_abs"], ".3g")
    debugged = json.loads((healthy["folder"] / "debug.json").read_text())["unet"]
    if debugged["first"]:
        add("first_error", debugged["first"]["error"], ".3g")
    else:
        add("largest_error", debugged["largest_error"], ".3g")
    for row in debugged["worst"]:
        add("error", row["error"], ".3g")
    for backend in json.loads((healthy["folder"] / "bench.json").read_text())["backends"]:
        if backend["status"] == "ok":
            add("total_s", backend["total_s"]["median"], ".4g")
            for stage in ("text_encoder", "unet", "scheduler_guidance", "vae_decode"):
                add(stage, backend["stages_s"][stage]["median"], ".4g")
    for row in json.loads((healthy["folder"] / "profile" / "steps.json").read_text()):
        add("step_ms", row["seconds"] * 1e3, ".2f")
        add("unet_ms", row["unet_seconds"] * 1e3, ".2f")
    # The one number not in any JSON: the difference map's scale, which the images give.
    scale = difference_map(*(load_images(healthy["stored"].parent)[name] for name in ("engine", "pytorch")))[1]
    add("difference_scale", scale, ".4g")
    return found


def test_a_stored_failing_image_keeps_its_non_finite_pixels(tmp_path):
    from sdtrt.tools.report_images import save_images

    engine = np.full((4, 4, 3), 0.5)
    engine[1, 2, 0] = np.nan  # one channel is enough to make the pixel NaN/inf
    save_images({"engine": engine, "pytorch": np.full((4, 4, 3), 0.25)}, tmp_path)
    loaded = load_images(tmp_path)
    assert np.isnan(loaded["engine"]).all(axis=-1).sum() == 1 and np.isnan(loaded["engine"][1, 2]).all()
    colors, scale, non_finite = difference_map(loaded["engine"], loaded["pytorch"])
    assert non_finite == 1 / 16 and tuple(colors[1, 2]) == (0, 255, 255) and scale == pytest.approx(0.25, abs=0.01)


def test_identical_latents_are_left_off_the_drift_chart_not_drawn_as_failures(healthy):
    from sdtrt.tools.report_sections import drift_section
    from sdtrt.tools.validate import ValidationReport

    stored = json.loads((healthy["stored"].parent / REPORT).read_text())
    stored["image"]["drift"] = [
        {"step": 0, "cosine": 1.0, "psnr_db": float("inf"), "max_abs": 0.0},
        {"step": 1, "cosine": 0.999, "psnr_db": 41.0, "max_abs": 0.01},
        {"step": 2, "cosine": float("nan"), "psnr_db": float("nan"), "max_abs": float("nan")},
    ]
    charts = drift_section([ValidationReport.from_json(stored)]).split("<svg")[1:3]
    assert [chart.count('class="nonfinite"') for chart in charts] == [1, 1], "only the NaN step is a cross"


def test_a_bare_onnx_is_hashed_once_while_it_is_unchanged(tmp_path, monkeypatch):
    import sdtrt.core.artifact as artifact_module

    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"not parsed: only hashed")
    hashed = []
    real = artifact_module.file_sha256
    monkeypatch.setattr(artifact_module, "file_sha256", lambda path: hashed.append(path) or real(path))
    first = Artifact.open(graph).key
    assert Artifact.open(graph).key == first and len(hashed) == 1
    graph.write_bytes(b"changed: hashed again")
    assert Artifact.open(graph).key != first and len(hashed) == 2


def test_charts_mark_outliers_non_finite_values_and_the_first_layer():
    from sdtrt.tools.report_svg import Axis, LineChart, Marker, Series, column_chart, line_chart

    columns = column_chart("steps", "ms", [10.0, 11.0, 30.0], [False, False, True], "outlier")
    assert columns.count('class="column outlier"') == 1 and columns.count('class="column"') == 2
    assert ">outlier</text>" in columns, "the outlier is labelled, not only coloured"
    points = [(0.0, 1e-4), (1.0, 0.2), (2.0, float("inf")), (3.0, float("nan"))]
    chart = LineChart("errors", Axis("layer"), Axis("error", log=True), [Series("e", points)], (0.05, "limit"),
                      [Marker(1.0, "layer 1: Conv")])  # fmt: skip
    drawn = line_chart(chart)
    assert drawn.count("<circle") == 2 and drawn.count('class="nonfinite"') == 2, "NaN/inf: crosses, not points"
    assert drawn.count('class="marker"') == 1 and "layer 1: Conv" in drawn and 'class="threshold"' in drawn


def test_a_bar_without_a_stage_keeps_the_others_colours_and_a_zero_reference_has_a_latent_psnr():
    import torch

    from sdtrt.tools.image_quality import latent_psnr_db
    from sdtrt.tools.report_svg import Bar, stacked_bars

    drawn = stacked_bars("t", "s", [Bar("a", [("x", 1.0), ("z", 2.0)])], ["x", "y", "z"])
    assert 'class="segment s0"' in drawn and 'class="segment s2"' in drawn and "s1" not in drawn
    assert math.isfinite(latent_psnr_db(torch.ones(4), torch.zeros(4)))


def test_a_validation_file_that_is_stored_already_is_shown_once(healthy, store, tmp_path):
    given = ReportConfig(tmp_path / "r.html", validations=(healthy["stored"].parent / REPORT,))
    page = write_report(healthy["set"], store, given).read_text()
    assert page.count('class="case passed"') == 1


def test_an_image_case_says_its_size_width_first_as_every_message_does():
    from sdtrt.tools.report_sections import case_label
    from sdtrt.tools.validate import Tolerances, ValidationReport

    case = {"scheduler": "euler", "pipeline": "FluxPipeline", "height": 128, "width": 192, "steps": 4, "seed": 7}
    report = ValidationReport("e", "tiny-flux", "fp32", Tolerances.for_precision("fp32"), image={"case": case})
    assert case_label(report) == "euler · FluxPipeline · 192×128 px (w×h) · 4 steps · seed 7"
