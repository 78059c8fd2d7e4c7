"""Small inline-SVG charts (line and stacked bar) for the HTML report: no plotting library, no scripts.

Why not matplotlib or a JS library: the report must be one self-contained file that renders offline in any
browser, and rlpipe should not pull a plotting stack into every machine that runs the flow. Hand-written
SVG is text, small, exact, and testable (every series is a `<polyline class="series">`, every bar a
`<rect class="bar">`, each with a `<title>` tooltip holding its value; a series' interval band, e.g. pass@k's
95% bootstrap interval, is a translucent `<polygon class="band">` under its line, or a whisker `<line
class="band">` at a point with no neighbour).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from html import escape

# Colour-blind-friendly palette (Okabe-Ito), then greys.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000", "#999999")
STATUS_COLOURS = {"ok": "#009E73", "fail": "#D55E00", "timeout": "#E69F00", "error": "#CC79A7", "no_code": "#999999"}

Scale = Callable[[float], float]
WIDTH, HEIGHT = 560, 280
LEFT, RIGHT, TOP, BOTTOM = 56, 132, 30, 44  # plot margins; the legend sits in the right margin


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float | None]  # None: no value at this x (a gap)
    colour: str | None = None
    dashed: bool = False
    band: tuple[list[float | None], list[float | None]] | None = None  # (lows, highs) at xs; None: no band


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _segments(xs: list[float], *columns: list[float | None]) -> list[list[tuple[float, ...]]]:
    """Runs of consecutive xs where every column has a finite value: a gap (None, NaN) splits a line."""
    segments: list[list[tuple[float, ...]]] = [[]]
    for x, *values in zip(xs, *columns, strict=True):
        if all(_finite(v) for v in values):
            segments[-1].append((x, *values))
        elif segments[-1]:
            segments.append([])
    return [segment for segment in segments if segment]


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [low, high] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high <= low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))

    def ticks_with(step: float) -> int:
        return math.ceil(high / step - 1e-9) - math.floor(low / step + 1e-9) + 1

    # The round step whose tick count is closest to `count` (ties: more ticks), at most count + 1 ticks.
    steps = [m * magnitude for m in (1, 2, 2.5, 5, 10) if ticks_with(m * magnitude) <= count + 1]
    step = min(steps, key=lambda s: (abs(ticks_with(s) - count), s))
    start = math.floor(low / step + 1e-9)
    return [round((start + i) * step, 12) for i in range(ticks_with(step))]


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.2g}"
    return f"{value:.3g}"


def _frame(chart_id: str, title: str, body: list[str], width: int = WIDTH, height: int = HEIGHT) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(chart_id)}" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>'
        f'<text x="{LEFT}" y="18" font-size="13" font-weight="600" fill="#222">{escape(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def _axes(
    xticks: list[tuple[float, str]], yticks: list[float], sx: Scale, sy: Scale, x_label: str, y_label: str
) -> list[str]:
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = ['<g class="axes" font-size="11" fill="#444" stroke="none">']
    for value in yticks:
        y = sy(value)
        parts.append(f'<line x1="{LEFT}" x2="{plot_right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
    for value, label in xticks:
        x = sx(value)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{plot_bottom}" y2="{plot_bottom + 4}" stroke="#888"/>')
        parts.append(f'<text x="{x:.1f}" y="{plot_bottom + 16}" text-anchor="middle">{escape(label)}</text>')
    parts.append(f'<line x1="{LEFT}" x2="{plot_right}" y1="{plot_bottom}" y2="{plot_bottom}" stroke="#888"/>')
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{plot_bottom}" stroke="#888"/>')
    middle = (LEFT + plot_right) / 2
    parts.append(f'<text x="{middle:.1f}" y="{HEIGHT - 8}" text-anchor="middle">{escape(x_label)}</text>')
    parts.append(
        f'<text x="14" y="{(TOP + plot_bottom) / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(TOP + plot_bottom) / 2:.1f})">{escape(y_label)}</text>'
    )
    parts.append("</g>")
    return parts


def _legend(items: list[tuple[str, str, bool]]) -> list[str]:
    x = WIDTH - RIGHT + 12
    parts = ['<g class="legend" font-size="11" fill="#333">']
    for i, (name, colour, dashed) in enumerate(items):
        y = TOP + 8 + 16 * i
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        parts.append(f'<line x1="{x}" x2="{x + 18}" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="3"{dash}/>')
        parts.append(f'<text x="{x + 24}" y="{y + 4}">{escape(name)}</text>')
    parts.append("</g>")
    return parts


def _empty(chart_id: str, title: str, message: str = "no data yet") -> str:
    return _frame(chart_id, title, [
        f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" font-size="13" '
        f'fill="#888">{escape(message)}</text>'
    ])


def line_chart(
    chart_id: str, title: str, series: list[Series], x_label: str, y_label: str,
    y_range: tuple[float | None, float | None] = (None, None), x_labels: dict[float, str] | None = None,
) -> str:
    """Lines with point markers; `y_range` pins either end of the y axis (e.g. (0, 1) for rates)."""
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True) if _finite(y)]
    points += [(x, y) for s in series if s.band for x, low, high in zip(s.xs, *s.band, strict=True)
               for y in (low, high) if _finite(y)]
    if not points:
        return _empty(chart_id, title)
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    y_low = y_range[0] if y_range[0] is not None else min(ys)
    y_high = y_range[1] if y_range[1] is not None else max(ys)
    yticks = nice_ticks(min(y_low, min(ys)), max(y_high, max(ys)))
    x_low, x_high = min(xs), max(xs)
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT

    def sx(x: float) -> float:
        return LEFT + 10 + (x - x_low) / (x_high - x_low) * (plot_right - LEFT - 20)

    def sy(y: float) -> float:
        return plot_bottom - (y - yticks[0]) / (yticks[-1] - yticks[0]) * (plot_bottom - TOP)

    distinct_x = sorted(set(xs))
    if x_labels is None and len(distinct_x) > 12:
        xtick_values = nice_ticks(x_low, x_high, 8)
        xticks = [(v, _fmt(v)) for v in xtick_values if x_low <= v <= x_high]
    else:
        xticks = [(v, (x_labels or {}).get(v, _fmt(v))) for v in distinct_x]
    body = _axes(xticks, yticks, sx, sy, x_label, y_label)
    legend = []
    colours = [s.colour or PALETTE[i % len(PALETTE)] for i, s in enumerate(series)]
    for s, colour in zip(series, colours, strict=True):  # bands first, under every line
        for segment in _segments(s.xs, *s.band) if s.band else []:
            tip = f"<title>{escape(s.name)} interval</title>"
            if len(segment) == 1:
                x, low, high = segment[0]
                body.append(f'<line class="band" data-series="{escape(s.name)}" x1="{sx(x):.1f}" x2="{sx(x):.1f}" '
                            f'y1="{sy(low):.1f}" y2="{sy(high):.1f}" stroke="{colour}" stroke-width="6" '
                            f'stroke-opacity="0.3">{tip}</line>')
                continue
            outline = [(sx(x), sy(high)) for x, _, high in segment] + [(sx(x), sy(low)) for x, low, _ in segment[::-1]]
            coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in outline)
            body.append(f'<polygon class="band" data-series="{escape(s.name)}" points="{coords}" fill="{colour}" '
                        f'fill-opacity="0.18" stroke="none">{tip}</polygon>')
    for s, colour in zip(series, colours, strict=True):
        legend.append((s.name, colour, s.dashed))
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        for segment in _segments(s.xs, s.ys):  # gaps (None) split the line
            if len(segment) > 1:
                coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in segment)
                body.append(f'<polyline class="series" data-series="{escape(s.name)}" points="{coords}" '
                            f'fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for x, y in zip(s.xs, s.ys, strict=True):
            if y is not None and math.isfinite(y):
                label = (x_labels or {}).get(x, _fmt(x))
                body.append(f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                            f"<title>{escape(s.name)} at {escape(label)}: {y:.4g}</title></circle>")
    return _frame(chart_id, title, body + _legend(legend))


def stacked_bar_chart(
    chart_id: str, title: str, categories: list[str], stacks: dict[str, list[float]], x_label: str, y_label: str,
    colours: dict[str, str] | None = None, normalise: bool = False,
) -> str:
    """One bar per category, stacked by key; `normalise` turns each bar into fractions of its total."""
    if not categories or not stacks:
        return _empty(chart_id, title)
    values = {name: list(vals) for name, vals in stacks.items()}
    if normalise:
        totals = [sum(values[name][i] for name in values) or 1.0 for i in range(len(categories))]
        values = {name: [v / totals[i] for i, v in enumerate(vals)] for name, vals in values.items()}
    heights = [sum(values[name][i] for name in values) for i in range(len(categories))]
    yticks = nice_ticks(0.0, max(max(heights), 1e-9))
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT
    slot = (plot_right - LEFT) / len(categories)
    bar = max(min(slot * 0.7, 48), 2)

    def sx(i: float) -> float:
        return LEFT + slot * (i + 0.5)

    def sy(y: float) -> float:
        return plot_bottom - (y - yticks[0]) / (yticks[-1] - yticks[0]) * (plot_bottom - TOP)

    step = max(1, math.ceil(len(categories) / 12))
    xticks = [(i, c) for i, c in enumerate(categories) if i % step == 0]
    body = _axes(xticks, yticks, sx, sy, x_label, y_label)
    legend = []
    for k, name in enumerate(values):
        colour = (colours or {}).get(name) or PALETTE[k % len(PALETTE)]
        legend.append((name, colour, False))
    bottoms = [0.0] * len(categories)
    for (name, colour, _), vals in zip(legend, values.values(), strict=True):
        for i, v in enumerate(vals):
            if v <= 0:
                continue
            y0, y1 = sy(bottoms[i]), sy(bottoms[i] + v)
            shown = f"{v:.1%}" if normalise else _fmt(v)
            body.append(f'<rect class="bar" data-series="{escape(name)}" x="{sx(i) - bar / 2:.1f}" y="{y1:.1f}" '
                        f'width="{bar:.1f}" height="{max(y0 - y1, 0.5):.1f}" fill="{colour}">'
                        f"<title>{escape(name)} at {escape(categories[i])}: {shown}</title></rect>")
            bottoms[i] += v
    return _frame(chart_id, title, body + _legend(legend))
