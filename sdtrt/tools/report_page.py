"""The HTML report's page: one self-contained file (styles, images and charts inline, no request to any network), in
light and dark mode (``prefers-color-scheme``), printable, and usable by keyboard: the sections are landmarks a
table of contents links to, each chart has its numbers in a table beside it, and the image flip is a range input.

Every number shown carries the value it was formatted from (``data-value``, as in the JSON) and its name
(``data-key``), so what the page says can be checked against the JSON it came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from html import escape

from .. import __version__

HEAT_STOPS = ("#000004", "#3b0f70", "#8c2981", "#de4968", "#fe9f6d", "#fcfdbf")  # magma at 0, .2, …, 1

STYLE = """
:root { color-scheme: light dark; --bg: #ffffff; --fg: #1b1d21; --muted: #5b6270; --line: #d5d9e0; --panel: #f4f6f9;
  --pass: #17753a; --fail: #b3261e; --warn: #9a5b00; --link: #0b57d0;
  --s0: #0b57d0; --s1: #c2410c; --s2: #15803d; --s3: #7e22ce; --s4: #a16207; --s5: #0e7490; }
@media (prefers-color-scheme: dark) {
  :root { --bg: #16181d; --fg: #e6e8ec; --muted: #a4abb8; --line: #3a3f4a; --panel: #20242b;
    --pass: #6fdc8c; --fail: #ff8a80; --warn: #ffcc66; --link: #8ab4f8;
    --s0: #8ab4f8; --s1: #fdba74; --s2: #86efac; --s3: #d8b4fe; --s4: #fde047; --s5: #67e8f9; }
}
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 72rem; padding: 1rem 1.5rem 3rem; background: var(--bg); color: var(--fg);
  font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; }
a { color: var(--link); } a:focus-visible, input:focus-visible, summary:focus-visible {
  outline: 3px solid var(--link); outline-offset: 2px; }
h1 { font-size: 1.5rem; margin-bottom: .25rem; } h2 { border-bottom: 1px solid var(--line); padding-bottom: .25rem; }
h3 { font-size: 1.05rem; margin: 1.25rem 0 .5rem; }
nav ol { display: flex; flex-wrap: wrap; gap: .25rem 1rem; padding: 0; list-style: none; }
.muted, .tick, .label, .note { color: var(--muted); fill: var(--muted); }
.pass { color: var(--pass); font-weight: 600; } .fail { color: var(--fail); font-weight: 600; }
table { border-collapse: collapse; margin: .5rem 0; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--line); padding: .25rem .6rem; text-align: left; vertical-align: top; }
td.n, th.n { text-align: right; } tr.failed td { background: color-mix(in srgb, var(--fail) 12%, transparent); }
code, pre { font: 13px/1.4 ui-monospace, "SFMono-Regular", Menlo, monospace; }
pre { background: var(--panel); padding: .6rem .8rem; overflow-x: auto; white-space: pre-wrap; }
.case { background: var(--panel); border: 1px solid var(--line); padding: .75rem 1rem; margin: 1rem 0; }
.case.failed { border-left: 6px solid var(--fail); } .case.passed { border-left: 6px solid var(--pass); }
.images { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: .75rem; }
figure { margin: 0; } figcaption { font-size: .9rem; color: var(--muted); }
.images img, .flip img { width: 100%; image-rendering: pixelated; display: block; border: 1px solid var(--line); }
.flip { position: relative; max-width: 24rem; --split: 50%; }
.flip img.over { position: absolute; inset: 0; clip-path: inset(0 0 0 var(--split)); }
.flip-control { display: flex; align-items: center; gap: .5rem; max-width: 24rem; }
.flip-control input { flex: 1; }
.scale { height: 12px; border: 1px solid var(--line); print-color-adjust: exact; -webkit-print-color-adjust: exact;
  background: linear-gradient(to right, HEAT); }
.scale-ticks { display: flex; justify-content: space-between; font-size: .85rem; color: var(--muted); }
svg.chart { width: 100%; max-width: 48rem; height: auto; display: block; }
svg .plot { fill: none; stroke: var(--line); } svg .grid { stroke: var(--line); stroke-dasharray: 2 3; }
svg text { font-size: 11px; } svg .label { font-size: 12px; }
svg .series polyline { fill: none; stroke-width: 2; } svg .series circle { stroke: none; }
svg .threshold { stroke: var(--warn); stroke-dasharray: 6 4; stroke-width: 1.5; }
svg .marker { stroke: var(--fail); stroke-width: 2; } svg .marker-label { fill: var(--fail); font-weight: 600; }
svg .nonfinite { stroke: var(--fail); stroke-width: 2; fill: none; }
svg .column { fill: var(--s0); } svg .column.outlier { fill: var(--fail); }
SERIES
.legend { display: flex; flex-wrap: wrap; gap: .25rem 1rem; font-size: .9rem; padding: 0; list-style: none; }
.legend li::before { content: ""; display: inline-block; width: .8em; height: .8em; margin-right: .35em;
  background: var(--c); print-color-adjust: exact; -webkit-print-color-adjust: exact; }
@media print {
  body { max-width: none; font-size: 11pt; } nav, .flip-block { display: none; }
  section, .case, figure, svg { break-inside: avoid; } a { color: inherit; }
}
"""
_SERIES_CSS = "\n".join(
    f"svg .s{k} polyline {{ stroke: var(--s{k}); }} svg .s{k} circle, svg .segment.s{k} {{ fill: var(--s{k}); }}"
    for k in range(6)
)

# The flip's images are the figures' (each data URI is in the page once); its slider moves the split between them;
# printing opens every data table.
SCRIPT = """
for (const img of document.querySelectorAll("img[data-same-as]")) {
  img.src = document.getElementById(img.dataset.sameAs).src;
}
for (const input of document.querySelectorAll("input[data-flip]")) {
  const flip = document.getElementById(input.dataset.flip);
  const show = () => flip.style.setProperty("--split", input.value + "%");
  input.addEventListener("input", show); show();
}
window.addEventListener("beforeprint", () => document.querySelectorAll("details").forEach(d => d.open = true));
"""


def number(key: str, value: float | None, spec: str, unit: str = "") -> str:
    """A number as shown (``spec``), with the value it came from for a reader (or a test) to check."""
    if value is None:
        return '<span class="muted">—</span>'
    shown = format(value, spec) if math.isfinite(value) else ("NaN" if math.isnan(value) else f"{value}")
    return (
        f'<span class="num" data-key="{escape(key)}" data-value="{escape(json.dumps(value))}">{shown}'
        f"{unit and ' ' + escape(unit)}</span>"
    )


def verdict(passed: bool) -> str:
    return '<span class="pass">PASS</span>' if passed else '<span class="fail">FAIL</span>'


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = (), failed=()) -> str:
    """A table of HTML cells (already escaped); ``numeric`` columns align right, ``failed`` rows are tinted."""

    def css(name: str, applies: bool) -> str:
        return f' class="{name}"' if applies else ""

    head = "".join(f'<th scope="col"{css("n", i in numeric)}>{h}</th>' for i, h in enumerate(headers))
    body = "".join(
        f"<tr{css('failed', r in failed)}>"
        + "".join(f"<td{css('n', i in numeric)}>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for r, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def data_table(summary: str, headers: Sequence[str], rows: Sequence[Sequence[str]], numeric=()) -> str:
    """A chart's numbers, folded under it (opened for printing)."""
    return f"<details><summary>{escape(summary)}</summary>{table(headers, rows, numeric)}</details>"


def legend(names: Sequence[str]) -> str:
    items = "".join(f'<li style="--c: var(--s{k % 6})">{escape(n)}</li>' for k, n in enumerate(names))
    return f'<ul class="legend" aria-hidden="true">{items}</ul>'


def page(title: str, summary: str, sections: Sequence[tuple[str, str, str]]) -> str:
    """The whole document: ``sections`` as (id, heading, body HTML), the ones without a body left out."""
    shown = [(anchor, heading, body) for anchor, heading, body in sections if body]
    toc = "".join(f'<li><a href="#{a}">{escape(h)}</a></li>' for a, h, _ in shown)
    body = "".join(
        f'<section id="{a}" aria-labelledby="{a}-h"><h2 id="{a}-h">{escape(h)}</h2>{b}</section>' for a, h, b in shown
    )
    style = STYLE.replace("HEAT", ", ".join(HEAT_STOPS)).replace("SERIES", _SERIES_CSS)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">'
        f'<meta name="generator" content="sdtrt {__version__}"><style>{style}</style></head><body>'
        f'<header><h1>{escape(title)}</h1>{summary}<nav aria-label="Sections"><ol>{toc}</ol></nav></header>'
        f"<main>{body}</main><script>{SCRIPT}</script></body></html>"
    )
