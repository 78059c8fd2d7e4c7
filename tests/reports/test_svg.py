"""Inline SVG charts: ticks, gaps, empty charts, stacked bars; long legends and large values as a browser draws them."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from reports.svg import Series, _fmt, duration_unit, line_chart, nice_ticks, stacked_bar_chart
from tests.reports.test_report import CHROMIUM, assert_chart_text_fits, rendered_layout

SVG = "{http://www.w3.org/2000/svg}"


def test_nice_ticks_are_round_and_cover_the_range() -> None:
    assert nice_ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert nice_ticks(3.0, 47.0) == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    ticks = nice_ticks(0.0013, 0.0071)
    assert ticks[0] <= 0.0013 and ticks[-1] >= 0.0071 and len(ticks) <= 7
    assert nice_ticks(2.0, 2.0)[0] < 2.0 < nice_ticks(2.0, 2.0)[-1]


def test_line_chart_is_valid_svg_with_gaps_and_tooltips() -> None:
    svg = line_chart("c", "Reward <&>", [Series("a", [0, 1, 2, 3], [0.1, None, 0.5, 0.7]),
                                          Series("b", [0, 1, 2, 3], [0.2, 0.3, 0.4, 0.5], dashed=True)],
                     "iteration", "reward", y_range=(0.0, 1.0))
    root = ET.fromstring(svg)  # well-formed, title escaped
    assert root.get("id") == "c" and root.find(f"{SVG}title").text == "Reward <&>"
    lines = root.findall(f".//{SVG}polyline")
    # series a is split by its gap into [0] (a single point: no line) and [2, 3]; series b is one line
    assert [(p.get("data-series"), len(p.get("points").split())) for p in lines] == [("a", 2), ("b", 4)]
    assert len(root.findall(f".//{SVG}circle")) == 7
    assert "a at 2: 0.5" in svg and 'stroke-dasharray="5 4"' in svg


def test_empty_and_stacked_charts() -> None:
    assert "no data yet" in line_chart("e", "Nothing", [Series("x", [], [])], "x", "y")
    svg = stacked_bar_chart("s", "Mix", ["0", "1"], {"ok": [1, 3], "fail": [3, 1]}, "iteration", "share",
                            normalise=True)
    bars = ET.fromstring(svg).findall(f".//{SVG}rect[@class='bar']")
    assert len(bars) == 4
    heights = {(b.get("data-series"), b.find(f"{SVG}title").text) for b in bars}
    assert ("ok", "ok at 1: 75.0%") in heights and ("fail", "fail at 0: 75.0%") in heights
    assert len(re.findall(r"<text[^>]*>1</text>", svg)) == 2  # y tick "1" and x category "1"


def test_tick_values_read_as_numbers_and_time_in_a_unit() -> None:
    assert [_fmt(v) for v in (0.0, 0.25, 0.005, 40.0, 1000.0, 1500.0, 12000.0, 2.5e6)] == [
        "0", "0.25", "0.005", "40", "1,000", "1,500", "12k", "2.5M"]
    assert duration_unit(90) == (1.0, "seconds") and duration_unit(1500) == (60.0, "minutes")
    assert duration_unit(3 * 3600) == (3600.0, "hours")


LONG_NAMES = ["humaneval pass@1", "humaneval pass@4", "humaneval greedy accuracy", "pytasks pass@1", "pytasks pass@4",
              "pytasks greedy accuracy", "mine-360m solve rate", "mine-360m-longer-run-name solve rate"]


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian `chromium` (make system-deps installs it)")
def test_long_legends_and_large_values_fit_as_rendered(tmp_path: Path) -> None:
    """The issue's charts: eight long legend names (pass@1 must be told from pass@4), y values in the thousands
    of seconds and x steps past a thousand. Rendered in Chromium, every legend name shows whole, ticks read
    `1,500`-style, and no text leaves its chart or covers another (the y label over the tick labels)."""
    xs = [float(x) for x in range(0, 1600, 100)]
    lines = line_chart("long", "Held-out pass@k", [Series(name, xs, [0.05 * i + x / 4000 for x in xs])
                                                   for i, name in enumerate(LONG_NAMES)],
                       "step", "fraction of prompts", y_range=(0.0, 1.0))
    times = stacked_bar_chart("time", "Time per stage", ["run", *map(str, range(30))],
                              {"generate": [900.0 + 50 * i for i in range(31)], "train": [4000.0] * 31},
                              "iteration", "seconds")
    page = tmp_path / "charts.html"
    page.write_text(f"<!DOCTYPE html><html><body>{lines}{times}</body></html>")
    charts = {chart["id"]: chart for chart in rendered_layout(str(page), tmp_path)["charts"]}
    for chart in charts.values():
        assert_chart_text_fits(chart)
    assert [t["text"] for t in charts["long"]["texts"] if t["kind"] == "legend"] == LONG_NAMES
    ticks = [t["text"] for chart in charts.values() for t in chart["texts"] if t["kind"] == "tick"]
    assert "1,000" in ticks and "8,000" in ticks and not [t for t in ticks if "e+" in t or "e-" in t]
