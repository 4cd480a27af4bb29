"""Charts of the HTML report as inline SVG: no script and no library, so a report opens anywhere, prints as drawn and
follows the page's light or dark colours (every colour is a CSS variable the page sets).

Each chart is an ``<svg role="img">`` with a title a screen reader speaks; the page puts its numbers in a table
beside it, which is what a keyboard user reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 44  # margins: the y labels on the left, the x labels below


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]  # (x, y); a non-finite y is drawn as a mark on the axis, not a point
    joined: bool = True  # a line through the points; False: dots only (hundreds of layers, each its own)


@dataclass(frozen=True)
class Marker:
    """A vertical line at ``x`` with a label: the first layer over tolerance."""

    x: float
    label: str


@dataclass(frozen=True)
class Axis:
    label: str
    log: bool = False


@dataclass(frozen=True)
class LineChart:
    title: str
    x: Axis
    y: Axis
    series: Sequence[Series]
    threshold: tuple[float, str] | None = None  # a horizontal line (the tolerance) and its label
    markers: Sequence[Marker] = field(default_factory=tuple)


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _format(value: float) -> str:
    return f"{value:g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.0e}"


class _Frame:
    """The plot area's scales: data to pixels."""

    def __init__(self, x: tuple[float, float], y: tuple[float, float], log_y: bool) -> None:
        self.x0, self.x1 = x if x[1] > x[0] else (x[0] - 0.5, x[0] + 0.5)
        self.log_y = log_y
        low, high = y
        if log_y:  # whole decades, so the axis has at least two labelled ticks
            low, high = float(math.floor(math.log10(low))), float(math.ceil(math.log10(high)))
        self.y0, self.y1 = (low, high) if high > low else (low - 1, high + 1)

    def px(self, x: float) -> float:
        return LEFT + (x - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT)

    def py(self, y: float) -> float:
        value = math.log10(y) if self.log_y else y
        value = min(max(value, self.y0), self.y1)
        return HEIGHT - BOTTOM - (value - self.y0) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM)

    def y_ticks(self) -> list[float]:
        if self.log_y:
            return [10.0**e for e in range(math.ceil(self.y0), math.floor(self.y1) + 1)]
        return _ticks(self.y0, self.y1)


def _open(title: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{escape(title)}" '
        f'xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>'
    )


def _axes(frame: _Frame, x_ticks: Sequence[float], x_label: str, y_label: str, x_names: dict[float, str]) -> str:
    parts = [
        f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}"/>'
    ]
    for tick in frame.y_ticks():
        y = frame.py(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_format(tick)}</text>')
    for tick in x_ticks:
        x = frame.px(tick)
        name = escape(x_names.get(tick, _format(tick)))
        parts.append(f'<text class="tick" x="{x:.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{name}</text>')
    parts.append(f'<text class="label" x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 6}" text-anchor="middle">')
    parts.append(f"{escape(x_label)}</text>")
    parts.append(f'<text class="label" transform="translate(14 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" ')
    parts.append(f'text-anchor="middle">{escape(y_label)}</text>')
    return "".join(parts)


def line_chart(chart: LineChart) -> str:
    """Lines over x, one per series, in the palette's order; a legend below the title where there are several."""
    xs = [x for s in chart.series for x, _ in s.points]
    ys = [y for s in chart.series for _, y in s.points if math.isfinite(y) and (y > 0 or not chart.y.log)]
    x_range = (min(xs, default=0.0), max(xs, default=1.0))
    y_range = (min(ys, default=1.0), max(ys, default=1.0))
    if chart.threshold:
        y_range = (min(y_range[0], chart.threshold[0]), max(y_range[1], chart.threshold[0]))
    frame = _Frame(x_range, y_range, chart.y.log)
    parts = [_open(chart.title), _axes(frame, _ticks(*x_range), chart.x.label, chart.y.label, {})]
    if chart.threshold:
        y = frame.py(chart.threshold[0])
        parts.append(f'<line class="threshold" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}"/>')
        label_y = y + 14 if y < TOP + 24 else y - 4  # near the top, where NaN/inf crosses are: under the line
        parts.append(f'<text class="note" x="{WIDTH - RIGHT - 4}" y="{label_y:.1f}" text-anchor="end">')
        parts.append(f"{escape(chart.threshold[1])}</text>")
    for index, series in enumerate(chart.series):
        finite = [(x, y) for x, y in series.points if math.isfinite(y) and (y > 0 or not chart.y.log)]
        path = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in finite)
        color = f"s{index % 6}"
        parts.append(f'<g class="series {color}"><title>{escape(series.name)}</title>')
        if len(finite) > 1 and series.joined:
            parts.append(f'<polyline points="{path}"/>')
        radius = 2.5 if series.joined else 1.8
        parts += [f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="{radius}"/>' for x, y in finite]
        for x, y in series.points:  # NaN/inf: a cross at the top of the plot, where the value left the scale
            if not math.isfinite(y):
                cx, cy = frame.px(x), TOP + 6
                parts.append(f'<path class="nonfinite" d="M{cx - 4:.1f},{cy - 4} l8,8 m0,-8 l-8,8"/>')
        parts.append("</g>")
    for marker in chart.markers:
        x = frame.px(marker.x)
        parts.append(f'<line class="marker" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{HEIGHT - BOTTOM}"/>')
        anchor = "end" if x > WIDTH / 2 else "start"
        shift = -4 if anchor == "end" else 4
        parts.append(f'<text class="marker-label" x="{x + shift:.1f}" y="{TOP + 14}" text-anchor="{anchor}">')
        parts.append(f"{escape(marker.label)}</text>")
    return "".join(parts) + "</svg>"


@dataclass(frozen=True)
class Bar:
    name: str
    segments: Sequence[tuple[str, float]]  # (stage, value), stacked left to right in this order
    total: float | None = None  # the label right of the bar (default: the segments' sum)


def stacked_bars(title: str, unit: str, bars: Sequence[Bar], stages: Sequence[str]) -> str:
    """Horizontal bars, one per name, each split into its segments; a segment takes the palette colour of its
    stage's place in ``stages`` (the legend's order), so a bar that lacks a stage keeps the others' colours."""
    row, gap, label_room = 28, 10, 80  # label_room: the total's label right of the longest bar
    height = TOP + len(bars) * (row + gap)
    total = max((sum(v for _, v in bar.segments) for bar in bars), default=1.0) or 1.0
    left = LEFT + 60
    scale = (WIDTH - RIGHT - left - label_room) / total
    parts = [_open(title).replace(f"0 0 {WIDTH} {HEIGHT}", f"0 0 {WIDTH} {height}")]
    for index, bar in enumerate(bars):
        y = TOP + index * (row + gap)
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + row / 2 + 4}" text-anchor="end">')
        parts.append(f"{escape(bar.name)}</text>")
        x = float(left)
        for stage, value in bar.segments:
            width = value * scale
            color = f"s{stages.index(stage) % 6}"
            parts.append(f'<rect class="segment {color}" x="{x:.1f}" y="{y}" width="{width:.1f}" height="{row}">')
            parts.append(f"<title>{escape(bar.name)}: {escape(stage)} {value:.4g} {escape(unit)}</title></rect>")
            x += width
        shown = bar.total if bar.total is not None else sum(v for _, v in bar.segments)
        parts.append(f'<text class="tick" x="{x + 4:.1f}" y="{y + row / 2 + 4}">{shown:.4g} {escape(unit)}</text>')
    return "".join(parts) + "</svg>"


def column_chart(title: str, y_label: str, values: Sequence[float], flagged: Sequence[bool], flag_label: str) -> str:
    """One column per value (per denoising step), the flagged ones (outliers) in the warning colour and labelled."""
    frame = _Frame((-0.5, len(values) - 0.5), (0.0, max(values, default=1.0) * 1.1 or 1.0), False)
    step = max(1, len(values) // 10)
    ticks = [float(i) for i in range(0, len(values), step)]
    parts = [_open(title), _axes(frame, ticks, "step", y_label, {})]
    width = (WIDTH - LEFT - RIGHT) / max(len(values), 1) * 0.7
    for index, (value, flag) in enumerate(zip(values, flagged, strict=True)):
        x, y = frame.px(index) - width / 2, frame.py(value)
        css = "column outlier" if flag else "column"
        parts.append(f'<rect class="{css}" x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" ')
        parts.append(f'height="{HEIGHT - BOTTOM - y:.1f}"><title>step {index}: {value:.4g}')
        parts.append(f"{' (' + escape(flag_label) + ')' if flag else ''}</title></rect>")
        if flag:
            parts.append(f'<text class="marker-label" x="{x + width / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle">')
            parts.append(f"{escape(flag_label)}</text>")
    return "".join(parts) + "</svg>"
