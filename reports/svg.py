"""Small inline-SVG charts (line and stacked bar) for the HTML report: no plotting library, no scripts.

Why not matplotlib or a JS library: the report must be one self-contained file that renders offline in any
browser, and rlpipe should not pull a plotting stack into every machine that runs the flow. Hand-written
SVG is text, small, exact, and testable (every series is a `<polyline class="series">`, every bar a
`<rect class="bar">`, each with a `<title>` tooltip holding its value; a series' interval band, e.g. pass@k's
95% bootstrap interval, is a translucent `<polygon class="band">` under its line, or a whisker `<line
class="band">` at a point with no neighbour). The legend sits below the axes in as many rows as its names need,
so a long name (`humaneval pass@4`) is shown whole; the left margin grows with the widest y tick label, so
the rotated axis label never covers a tick, and ticks read `1,500` or `12k`, never `1e+03`.
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
WIDTH, HEIGHT = 560, 280  # HEIGHT holds the title, the plot and its axes; the legend adds rows below it
RIGHT, TOP, BOTTOM = 16, 30, 44  # plot margins; the left one is sized to the y tick labels (`left_margin`)
# An 11px sans-serif character's width, rounded up (digits and lower case are ~6 px): sizes the left margin
# and the legend's rows without a browser to measure text. The headless-browser test checks the result fits.
CHAR_WIDTH = 6.6
Y_LABEL_BAND = 22  # the rotated y-axis label, left of the tick labels
LEGEND_ROW, LEGEND_GAP, LEGEND_SWATCH = 16, 18, 24


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
    """A tick value as short text: `1,500`, `12k`, `2.5M`, `0.25`, `0.005` (never `1e+03`)."""
    magnitude = abs(value)
    if value == 0:
        return "0"
    if magnitude >= 1e6:
        return f"{value / 1e6:.3g}M"
    if magnitude >= 1e4:
        return f"{value / 1e3:.3g}k"
    if magnitude >= 1000:
        return f"{value:,.0f}"
    return f"{value:.2g}" if magnitude < 0.01 else f"{value:.3g}"


def duration_unit(longest_seconds: float) -> tuple[float, str]:
    """(seconds per unit, unit name) for a time axis whose longest value is `longest_seconds`."""
    if longest_seconds >= 2 * 3600:
        return 3600.0, "hours"
    if longest_seconds >= 2 * 60:
        return 60.0, "minutes"
    return 1.0, "seconds"


def text_width(text: str) -> float:
    return len(text) * CHAR_WIDTH


def left_margin(tick_labels: list[str]) -> int:
    """Room for the rotated y-axis label, the widest y tick label and a gap before the axis."""
    return math.ceil(Y_LABEL_BAND + max((text_width(t) for t in tick_labels), default=0.0) + 8)


def thin_ticks(ticks: list[tuple[float, str]], positions: list[float]) -> list[tuple[float, str]]:
    """Every n-th x tick, n the smallest that keeps neighbouring labels (at pixel `positions`) apart."""
    if len(ticks) < 2:
        return ticks
    spacing = min(b - a for a, b in zip(positions, positions[1:], strict=False)) or 1.0
    widest = max(text_width(label) for _, label in ticks) + 8
    step = max(1, math.ceil(widest / spacing))
    return ticks[::step]


def _frame(chart_id: str, title: str, body: list[str], height: int = HEIGHT) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(chart_id)}" '
        f'viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
        f'aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
        f'<rect x="0" y="0" width="{WIDTH}" height="{height}" fill="#ffffff"/>'
        f'<text class="chart-title" x="12" y="18" font-size="13" font-weight="600" fill="#222">{escape(title)}</text>'
        + "".join(body)
        + "</svg>"
    )


def _axes(
    xticks: list[tuple[float, str]], yticks: list[float], sx: Scale, sy: Scale, x_label: str, y_label: str,
    left: int,
) -> list[str]:
    """Grid lines and y tick labels right of the y label's band, x tick labels, the two axis labels."""
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = ['<g class="axes" font-size="11" fill="#444" stroke="none">']
    for value in yticks:
        y = sy(value)
        parts.append(f'<line x1="{left}" x2="{plot_right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(value)}</text>')
    for value, label in xticks:
        x = sx(value)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{plot_bottom}" y2="{plot_bottom + 4}" stroke="#888"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{plot_bottom + 16}" text-anchor="middle">'
                     f"{escape(label)}</text>")
    parts.append(f'<line x1="{left}" x2="{plot_right}" y1="{plot_bottom}" y2="{plot_bottom}" stroke="#888"/>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{TOP}" y2="{plot_bottom}" stroke="#888"/>')
    middle = (left + plot_right) / 2
    parts.append(f'<text class="axis-label" x="{middle:.1f}" y="{HEIGHT - 8}" text-anchor="middle">'
                 f"{escape(x_label)}</text>")
    y_middle, y_x = (TOP + plot_bottom) / 2, Y_LABEL_BAND / 2 + 2
    parts.append(f'<text class="axis-label" x="{y_x}" y="{y_middle:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 {y_x} {y_middle:.1f})">{escape(y_label)}</text>')
    parts.append("</g>")
    return parts


def _legend(items: list[tuple[str, str, bool]]) -> tuple[list[str], int]:
    """The legend below the axes, items flowing left to right in rows (a name too long for a row is cut, its
    full text in a tooltip): its SVG elements and the chart's height with it."""
    usable = WIDTH - 24
    parts = ['<g class="legend" font-size="11" fill="#333">']
    x, row = 12.0, 0
    for name, colour, dashed in items:
        shown = name
        while len(shown) > 1 and LEGEND_SWATCH + text_width(shown) > usable:
            shown = shown[:-2] + "…"
        width = LEGEND_SWATCH + text_width(shown)
        if x > 12 and x + width > 12 + usable:
            x, row = 12.0, row + 1
        y = HEIGHT + 8 + LEGEND_ROW * row
        dash = ' stroke-dasharray="4 3"' if dashed else ""
        parts.append(f'<line x1="{x:.1f}" x2="{x + 18:.1f}" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="3"'
                     f"{dash}/>")
        tip = f"<title>{escape(name)}</title>" if shown != name else ""
        parts.append(f'<text x="{x + LEGEND_SWATCH:.1f}" y="{y + 4}">{escape(shown)}{tip}</text>')
        x += width + LEGEND_GAP
    parts.append("</g>")
    return parts, (HEIGHT + LEGEND_ROW * (row + 1) + 4 if items else HEIGHT)


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
    left = left_margin([_fmt(v) for v in yticks])
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT

    def sx(x: float) -> float:
        return left + 10 + (x - x_low) / (x_high - x_low) * (plot_right - left - 20)

    def sy(y: float) -> float:
        return plot_bottom - (y - yticks[0]) / (yticks[-1] - yticks[0]) * (plot_bottom - TOP)

    distinct_x = sorted(set(xs))
    if x_labels is None and len(distinct_x) > 12:
        xtick_values = nice_ticks(x_low, x_high, 8)
        xticks = [(v, _fmt(v)) for v in xtick_values if x_low <= v <= x_high]
    else:
        xticks = [(v, (x_labels or {}).get(v, _fmt(v))) for v in distinct_x]
    body = _axes(thin_ticks(xticks, [sx(v) for v, _ in xticks]), yticks, sx, sy, x_label, y_label, left)
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
        dash = ' stroke-dasharray="5 4"' if s.dashed else ""
        for segment in _segments(s.xs, s.ys):  # gaps (None) split the line
            if len(segment) > 1:
                coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in segment)
                body.append(f'<polyline class="series" data-series="{escape(s.name)}" points="{coords}" '
                            f'fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for x, y in zip(s.xs, s.ys, strict=True):
            if y is not None and math.isfinite(y):
                label = (x_labels or {}).get(x, f"{x:g}")
                body.append(f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                            f"<title>{escape(s.name)} at {escape(label)}: {y:.4g}</title></circle>")
    legend, height = _legend([(s.name, colour, s.dashed) for s, colour in zip(series, colours, strict=True)])
    return _frame(chart_id, title, body + legend, height)


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
    left = left_margin([_fmt(v) for v in yticks])
    plot_bottom, plot_right = HEIGHT - BOTTOM, WIDTH - RIGHT
    slot = (plot_right - left) / len(categories)
    bar = max(min(slot * 0.7, 48), 2)

    def sx(i: float) -> float:
        return left + slot * (i + 0.5)

    def sy(y: float) -> float:
        return plot_bottom - (y - yticks[0]) / (yticks[-1] - yticks[0]) * (plot_bottom - TOP)

    xticks = [(float(i), c) for i, c in enumerate(categories)]
    body = _axes(thin_ticks(xticks, [sx(i) for i, _ in xticks]), yticks, sx, sy, x_label, y_label, left)
    legend = [(name, (colours or {}).get(name) or PALETTE[k % len(PALETTE)], False) for k, name in enumerate(values)]
    bottoms = [0.0] * len(categories)
    for (name, colour, _), vals in zip(legend, values.values(), strict=True):
        for i, v in enumerate(vals):
            if v <= 0:
                continue
            y0, y1 = sy(bottoms[i]), sy(bottoms[i] + v)
            shown = f"{v:.1%}" if normalise else f"{v:.4g}"
            body.append(f'<rect class="bar" data-series="{escape(name)}" x="{sx(i) - bar / 2:.1f}" y="{y1:.1f}" '
                        f'width="{bar:.1f}" height="{max(y0 - y1, 0.5):.1f}" fill="{colour}">'
                        f"<title>{escape(name)} at {escape(categories[i])}: {shown}</title></rect>")
            bottoms[i] += v
    legend_parts, height = _legend(legend)
    return _frame(chart_id, title, body + legend_parts, height)
