"""``sdtrt report``: one self-contained HTML file per engine (or set) — the validated images side by side with their
difference, the drift over the denoising steps, the parity table, each member's precision, where `debug` saw the error
start, where `bench` and `profile` saw the time go, and how to make it all again.

The page needs no network and no server: images are PNG data URIs, charts inline SVG (report_svg.py), the styles and
the one small script (the image flip) inline. Sections without data are left out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape
from pathlib import Path

from ..core.artifact import Artifact
from ..core.errors import RequestError
from ..core.store import Store
from .report_data import ReportConfig, ReportData, gather
from .report_engine_sections import debug_section, precision_section, provenance_section, time_section
from .report_page import page, verdict
from .report_sections import drift_section, images_section, parity_section
from .validate import ValidationReport

REPORT_HTML = "report.html"  # beside a stored validation's report.json

__all__ = ["REPORT_HTML", "ReportConfig", "render_report", "write_report"]


def render_report(data: ReportData, out: Path) -> str:
    """The page for ``data``; ``out`` is where it will be written (links to trace files are relative to it)."""
    failed = [v for v in data.validations if not v]
    debugged = [c for c, r in data.debug.items() if r.get("first")]
    if data.validations:
        state = (
            f"{verdict(not failed)} {len(data.validations) - len(failed)} of {len(data.validations)} validations pass"
        )
    else:
        state = '<span class="muted">not validated: no validation report is stored for it or given</span>'
    if debugged:
        state += f" · <span class='fail'>debug: a layer diverges in {escape(', '.join(debugged))}</span>"
    summary = (
        f"<p>{state}</p><p class='muted'>{escape(data.model.get('name', '?'))} · {escape(data.engine.stage)} "
        f"{escape(data.engine.key[:16])} · {len(data.members)} member(s) · written {time.strftime('%Y-%m-%d %H:%M %Z')}"
        "</p>"
    )
    sections = [
        ("images", "Images", images_section(data.validations)),
        ("drift", "Drift over steps", drift_section(data.validations)),
        ("parity", "Per component", parity_section(data.validations, data.validation_sources)),
        ("precision", "Precision", precision_section(data)),
        ("debug", "Debug: where the error starts", debug_section(data)),
        ("time", "Time", time_section(data, out)),
        ("provenance", "Provenance", provenance_section(data)),
    ]
    return page(f"sdtrt report: {data.model.get('name', '?')} {data.engine.stage} {data.engine.key[:16]}", summary,
                sections)  # fmt: skip


def write_report(
    engine: Artifact,
    store: Store | None = None,
    config: ReportConfig = ReportConfig(),
    validations: Sequence[ValidationReport] = (),
) -> Path:
    """Write the HTML report of ``engine`` to ``config.out`` and return its path.

    It shows the ``validations`` given (a run's, with its images), every validation stored for the engine in
    ``store`` (compile's), and the results files ``config`` names (`validate`, `debug`, `bench` JSON, a `profile`
    folder). RequestError where a named file cannot be read or the page cannot be written.
    """
    data = gather(engine, store, config, validations)
    html = render_report(data, config.out)
    try:
        config.out.parent.mkdir(parents=True, exist_ok=True)
        config.out.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise RequestError(f"cannot write the report to {config.out} ({exc.strerror}); pass another --out") from exc
    return config.out
