"""The HTML report's sections about the engines themselves: what each member computes in, where `sdtrt debug` saw the
error start, where the time goes (`sdtrt bench`, `sdtrt profile`) and how to make them again."""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path
from typing import Any

from .bench import BREAKDOWN_STAGES
from .report_data import ReportData
from .report_page import data_table, legend, number, table
from .report_svg import Axis, Bar, LineChart, Marker, Series, column_chart, line_chart, stacked_bars

STAGE_LABELS = {"text_encoder": "text encoders", "unet": "denoiser", "scheduler_guidance": "scheduler + guidance",
                "vae_decode": "VAE decode"}  # fmt: skip
TIME_STAGES = tuple((stage, STAGE_LABELS[stage]) for stage in BREAKDOWN_STAGES)
LOWEST_ERROR = 1e-8  # the debug chart's floor: an exact layer sits on it


def precision_section(data: ReportData) -> str:
    rows, details = [], []
    for member in data.members:
        graph = ", ".join(f"{k}: {v}" for k, v in member.precision.items()) or "—"
        layers = ", ".join(f"{count} {kind}" for kind, count in sorted(member.layer_types.items())) or "—"
        kept = f"{len(member.kept_high_precision)} layers" if member.kept_high_precision else "—"
        rows.append([escape(member.component), escape(member.stage), escape(graph),
                     escape(member.quantization or "—"), escape(layers), kept])  # fmt: skip
        if member.kept_high_precision:
            kept_rows = [[f"<code>{escape(n)}</code>", escape(why)] for n, why in member.kept_high_precision.items()]
            details.append(
                data_table(f"{member.component}: layers kept in high precision", ["layer", "why"], kept_rows)
            )
    headers = ["member", "stage", "graph precision", "quantization", "layers by output type (TensorRT)", "kept high"]
    return table(headers, rows) + "".join(details)


def debug_section(data: ReportData) -> str:
    parts = []
    for component, report in data.debug.items():
        layers = report.get("layers") or []
        first, limit = report.get("first"), report["limit"]
        heading = f"{component}: " if component != "engine" else ""
        parts.append(f"<h3>{escape(heading)}{escape(str(report['compared']))} tensors compared on "
                     f"{escape(str(report['backend']))}</h3>")  # fmt: skip
        if first:
            what = (
                "turns NaN/inf"
                if not first["finite"]
                else "diverges (error " + number("first_error", first["error"], ".3g") + ")"
            )
            parts.append(
                '<p class="fail" data-role="first-layer">First layer over tolerance: '
                f"<code>{escape(first['tensor'])}</code>, output of {escape(first['op'])} node "
                f"<code>{escape(first['node'])}</code>, {what}.</p>"
            )
        else:
            parts.append(f'<p class="pass">No layer past the limit {limit:g}; largest error '
                         f"{number('largest_error', report['largest_error'], '.3g')}.</p>")  # fmt: skip
        if layers:
            parts.append(_debug_chart(component, layers, first, limit))
        worst = [[number("error", r["error"], ".3g"), escape(r["op"]), f"<code>{escape(r['tensor'])}</code>"]
                 for r in report.get("worst", [])]  # fmt: skip
        parts.append(data_table("The largest errors", ["error", "op", "tensor"], worst, (0,)))
    return "".join(parts)


def _debug_chart(component: str, layers: list[dict[str, Any]], first: dict[str, Any] | None, limit: float) -> str:
    points = [
        (float(i), max(row["error"], LOWEST_ERROR) if row["finite"] else math.inf) for i, row in enumerate(layers)
    ]
    markers = []
    if first:
        index = next(i for i, row in enumerate(layers) if row["tensor"] == first["tensor"])
        markers.append(Marker(float(index), f"layer {index}: {first['op']}"))  # its names are in the text above
    chart = LineChart(
        f"{component}: error of each layer against the fp32 replica, in the graph's order",
        Axis("layer (graph order)"),
        Axis("normalised max abs error", log=True),
        [Series("error", points, joined=False)],
        threshold=(limit, f"limit {limit:g}"),
        markers=markers,
    )
    return line_chart(chart)


def time_section(data: ReportData, out: Path) -> str:
    parts = []
    if data.bench:
        parts.append(_bench(data.bench))
    if data.profile_steps:
        seconds = [row["seconds"] * 1e3 for row in data.profile_steps]
        flagged = [bool(row["outlier"]) for row in data.profile_steps]
        parts.append("<h3>Per denoising step (sdtrt profile)</h3>")
        parts.append(column_chart("Latency of each denoising step", "ms", seconds, flagged, "outlier"))
        rows = [[escape(str(row["index"])), number("step_ms", row["seconds"] * 1e3, ".2f"),
                 number("unet_ms", row["unet_seconds"] * 1e3, ".2f"), "outlier" if row["outlier"] else ""]
                for row in data.profile_steps]  # fmt: skip
        parts.append(data_table("The numbers per step", ["step", "ms", "denoiser ms", ""], rows, (1, 2)))
    if data.traces:
        links = "".join(f'<li><a href="{escape(_link(p, out))}">{escape(p.name)}</a></li>' for p in data.traces)
        parts.append("<h3>Traces</h3><p class='muted'>trace.json opens in ui.perfetto.dev or chrome://tracing, "
                     f"flame.speedscope.json in speedscope.app.</p><ul>{links}</ul>")  # fmt: skip
    return "".join(parts)


def _bench(bench: dict[str, Any]) -> str:
    ran = [b for b in bench.get("backends", []) if b.get("status") == "ok" and b.get("stages_s")]
    bars = [
        Bar(
            b["name"],
            [(label, b["stages_s"][stage]["median"]) for stage, label in TIME_STAGES if stage in b["stages_s"]],
            (b.get("total_s") or {}).get("median"),  # a run's median total: its stages' medians need not sum to it
        )
        for b in ran
    ]
    parts = ["<h3>Stage breakdown per backend (sdtrt bench, medians)</h3>", legend([label for _, label in TIME_STAGES])]
    parts.append(stacked_bars("Median seconds per stage, per backend", "s", bars, [label for _, label in TIME_STAGES]))
    rows = [
        [escape(b["name"]), number("total_s", (b.get("total_s") or {}).get("median"), ".4g")]
        + [number(stage, b["stages_s"].get(stage, {}).get("median"), ".4g") for stage, _ in TIME_STAGES]
        for b in ran
    ]
    headers = ["backend", "total s", *[f"{label} s" for _, label in TIME_STAGES]]
    parts.append(table(headers, rows, numeric=range(1, 2 + len(TIME_STAGES))))
    for skipped in [b for b in bench.get("backends", []) if b.get("status") != "ok"]:
        parts.append(f"<p class='muted'>{escape(skipped['name'])}: {escape(skipped['status'])} — "
                     f"{escape(skipped.get('reason') or '')}</p>")  # fmt: skip
    return "".join(parts)


def _link(path: Path, out: Path) -> str:
    """A link that still works when the report and the traces move together: relative where they share a folder."""
    try:
        return Path(os.path.relpath(path.resolve(), out.resolve().parent)).as_posix()
    except ValueError:  # another drive
        return path.resolve().as_uri()


def provenance_section(data: ReportData) -> str:
    model = data.model
    engine = data.engine
    facts = [
        ["model", f"{escape(str(model.get('name')))} <span class='muted'>({escape(str(model.get('kind')))}"
                  f"{', ' + escape(str(model['path'])) if model.get('path') else ''})</span>"],
        ["engine", f"{escape(engine.stage)} <code>{escape(engine.key)}</code>"],
        ["path", f"<code>{escape(str(engine.path))}</code>"],
        ["made", escape(str(engine.manifest.get("created_at", "?")))],
    ]  # fmt: skip
    members = [[escape(m.component), escape(m.stage), f"<code>{escape(m.key)}</code>"] for m in data.members]
    versions = [[escape(name), escape(str(version))] for name, version in sorted(data.environment.items())]
    reproduce = "\n".join(data.reproduce)
    return (
        table(["", ""], facts)
        + "<h3>Members</h3>" + table(["member", "stage", "key"], members)
        + "<h3>Versions</h3>" + table(["library", "version"], versions)
        + (f"<h3>Reproduce</h3><pre>{escape(reproduce)}</pre>" if reproduce else "")
    )  # fmt: skip
