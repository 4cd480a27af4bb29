"""``sdtrt report``: one self-contained HTML file per engine (or set) — the validated images side by side with their
difference, the drift over the denoising steps, the parity table, each member's precision, where `debug` saw the error
start, where `bench` and `profile` saw the time go, and how to make it all again.

The page needs no network and no server: images are PNG data URIs, charts inline SVG (report_svg.py), the styles and
the one small script (the image flip) inline. Sections without data are left out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from html import escape
from pathlib import Path

from rich.markup import escape as markup_escape

from ..core.artifact import Artifact
from ..core.errors import RequestError
from ..core.progress import console
from ..core.store import Store
from .report_data import ReportConfig, ReportData, gather
from .report_engine_sections import debug_section, precision_section, provenance_section, time_section
from .report_page import page, verdict
from .report_sections import drift_section, images_section, parity_section
from .validate import ValidationReport

REPORT_HTML = "report.html"  # beside a stored validation's report.json

__all__ = ["REPORT_HTML", "ReportConfig", "render_report", "write_report", "write_report_or_warn"]


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
    folder). RequestError where a named file cannot be read or does not hold what that command writes, or where the
    page cannot be written.
    """
    data = gather(engine, store, config, validations)
    try:
        html = render_report(data, config.out)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a results file of another shape than expected
        given = [f"{option} {path}" for option, path in config.named_files()]
        raise RequestError(
            f"the report cannot read {', '.join(given) or 'the stored validations'} ({type(exc).__name__}: {exc}); "
            "pass the files the sdtrt commands wrote"
        ) from exc
    partial = config.out.with_name(f".{config.out.name}.{os.getpid()}.tmp")
    try:  # written whole or not at all: a reader (or a compile that rewrites it) never sees half a page
        config.out.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(html, encoding="utf-8")
        os.replace(partial, config.out)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise RequestError(f"cannot write the report to {config.out} ({exc.strerror}); write it elsewhere") from exc
    return config.out


def write_report_or_warn(
    engine: Artifact,
    store: Store | None = None,
    config: ReportConfig = ReportConfig(),
    validations: Sequence[ValidationReport] = (),
) -> Path | None:
    """``write_report`` for a command whose result is something else (compile, validate, deploy): the report is a
    by-product, so whatever stops it (a damaged stored artifact, an unreadable image, a folder it cannot write) is
    said in one line on stderr and the command goes on. The page's path, or None."""
    try:
        return write_report(engine, store, config, validations)
    except Exception as exc:  # whatever it is, it is not the command's own failure
        why = str(exc) if isinstance(exc, RequestError) else f"{type(exc).__name__}: {exc}"
        console.print(f"[yellow]![/] report not written: {markup_escape(why)}", soft_wrap=True)
        return None
