"""The validation sections of the HTML report: images side by side, drift over the denoising steps, the parity table.
Each returns "" where its data does not exist, and the page leaves it out."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from ..core.config import pixel_size
from .report_images import difference_map, png_data_uri, to_uint8
from .report_page import data_table, legend, number, table, verdict
from .report_svg import Axis, LineChart, Series, line_chart
from .validate import ValidationReport


def case_label(report: ValidationReport) -> str:
    """What an image comparison ran: scheduler, pipeline, size and steps (a report before they were recorded: its
    engine)."""
    case = (report.image or {}).get("case")
    if not case:
        return f"{report.precision} engine {report.engine}"
    return (
        f"{case['scheduler']} · {case['pipeline']} · {pixel_size(case['height'], case['width'])} · "
        f"{case['steps']} steps · seed {case['seed']}"
    )


def images_section(validations: list[ValidationReport]) -> str:
    parts = []
    for index, report in enumerate(v for v in validations if v.image):
        image = report.image
        assert image is not None
        state = "passed" if report else "failed"
        parts.append(f'<article class="case {state}" id="case-{index}" aria-label="{escape(case_label(report))}">')
        parts.append(f"<h3>{verdict(bool(report))} {escape(case_label(report))}</h3>")
        parts.append(
            f"<p>image PSNR {number('psnr_db', image['psnr_db'], '.2f', 'dB')} · SSIM "
            f"{number('ssim', image.get('ssim'), '.4f')} · tolerance PSNR ≥ {report.tolerances.min_psnr_db:g} dB</p>"
        )
        if image["failures"]:
            parts.append("<ul>" + "".join(f'<li class="fail">{escape(f)}</li>' for f in image["failures"]) + "</ul>")
        if {"pytorch", "engine"} <= report.images.keys():
            parts.append(_image_row(report, index))
        else:
            parts.append(
                '<p class="muted">The images were not kept with this report (a JSON file): its numbers only.</p>'
            )
        parts.append("</article>")
    return "".join(parts)


def _image_row(report: ValidationReport, index: int) -> str:
    pytorch, engine = report.images["pytorch"], report.images["engine"]
    heat, scale, non_finite = difference_map(engine, pytorch)
    cyan = f"cyan: NaN/inf ({non_finite:.0%} of the pixels)" if non_finite else "no NaN/inf"
    sources = {name: png_data_uri(to_uint8(report.images[name])) for name in ("pytorch", "engine")}
    figures = [
        f'<figure><img src="{sources["pytorch"]}" alt="PyTorch fp32 image" data-role="pytorch" id="pytorch-{index}">'
        "<figcaption>PyTorch fp32</figcaption></figure>",
        f'<figure><img src="{sources["engine"]}" alt="engine image" data-role="engine" id="engine-{index}">'
        f"<figcaption>engine ({escape(report.precision)})</figcaption></figure>",
        f'<figure><img src="{png_data_uri(heat)}" alt="|engine − PyTorch| heat map" data-role="difference">'
        '<div class="scale" role="img" aria-label="colour scale of the difference"></div>'
        f'<div class="scale-ticks"><span>0</span><span>{number("difference_scale", scale, ".4g")}</span></div>'
        f"<figcaption>|engine − PyTorch|, largest over the channels; {cyan}</figcaption></figure>",
    ]
    flip = (
        f'<div class="flip" id="flip-{index}">'
        f'<img class="under" data-same-as="pytorch-{index}" alt="PyTorch fp32 image">'
        f'<img class="over" data-same-as="engine-{index}" alt="engine image"></div>'
        f'<label class="flip-control">PyTorch<input type="range" min="0" max="100" value="50" data-flip="flip-{index}" '
        'aria-label="split between the PyTorch image (left) and the engine image (right)">engine</label>'
    )
    return f'<div class="images">{"".join(figures)}</div><div class="flip-block"><h4>Flip between them</h4>{flip}</div>'


def drift_section(validations: list[ValidationReport]) -> str:
    drifting = [v for v in validations if v.image and v.image.get("drift")]
    if not drifting:
        return ""
    names = [case_label(v) for v in drifting]
    drifts = [v.image["drift"] for v in drifting if v.image]
    charts = []
    for value, title, label, log in (
        (lambda row: _charted_psnr(row["psnr_db"]), "Latent PSNR, engine vs PyTorch, after each step",
         "latent PSNR (dB)", False),
        (lambda row: 1 - row["cosine"], "1 − cosine similarity of the latents, after each step (0: the same)",
         "1 − cosine", True),
    ):  # fmt: skip
        series = [
            Series(name, [(row["step"], y) for row in drift if (y := value(row)) is not None])
            for name, drift in zip(names, drifts, strict=True)
        ]
        charts.append(
            f"<h3>{escape(title)}</h3>" + line_chart(LineChart(title, Axis("step"), Axis(label, log), series))
        )
    rows = [
        [escape(name), str(row["step"]), number("drift_psnr_db", row["psnr_db"], ".2f"),
         number("drift_cosine", row["cosine"], ".6f")]
        for name, drift in zip(names, drifts, strict=True) for row in drift
    ]  # fmt: skip
    note = (
        '<p class="muted">Both pipelines denoise the same seeded latents; the engine\'s latents are compared with '
        "PyTorch's after every step, so the step where they part is where the error starts to grow. Identical "
        "latents have an infinite PSNR and are left off its chart; NaN/inf ones are crosses at its top.</p>"
    )
    headers = ["case", "step", "latent PSNR (dB)", "cosine"]
    return note + legend(names) + "".join(charts) + data_table("The numbers per step", headers, rows, (1, 2, 3))


def _charted_psnr(value: float | None) -> float | None:
    """Infinite PSNR (identical latents) has no place on a chart: left off it (None), not drawn as a failure's cross,
    which NaN (latents that are NaN/inf) is."""
    return None if value is None or value == math.inf else value


def parity_section(validations: list[ValidationReport], sources: list[str]) -> str:
    parts = []
    for report, source in zip(validations, sources, strict=True):
        if not report.tensors:
            continue
        rows = sorted(report.tensors, key=lambda row: not row["failures"])  # failures first, then the spec's order
        cells = [_parity_row(row, report) for row in rows]
        failed = {i for i, row in enumerate(rows) if row["failures"]}
        headers = ["input", "output", "cosine", "max abs", "mean abs", "tolerance", "result"]
        parts.append(f"<h3>{verdict(bool(report))} {escape(case_label(report))}</h3>")
        parts.append(f'<p class="muted">read from {escape(source)}</p>')
        parts.append(table(headers, cells, numeric=(2, 3, 4), failed=failed))
        if report.skipped:
            parts.append("<ul>" + "".join(f"<li>{escape(s)}</li>" for s in report.skipped) + "</ul>")
    return "".join(parts)


def _parity_row(row: dict[str, Any], report: ValidationReport) -> list[str]:
    held = row.get("tolerance") or {"min_cosine": report.tolerances.min_cosine, "max_abs": report.tolerances.max_abs}
    failures = "".join(f"<div>{escape(f)}</div>" for f in row["failures"])
    return [
        escape(row["case"]),
        escape(row.get("output", "")),
        number("cosine", row["cosine"], ".6f"),
        number("max_abs", row["max_abs"], ".3g"),
        number("mean_abs", row["mean_abs"], ".3g"),
        f"cosine ≥ {held['min_cosine']:g}, max abs ≤ {held['max_abs']:g}",
        f'<span class="fail">FAIL</span>{failures}' if row["failures"] else '<span class="pass">ok</span>',
    ]
