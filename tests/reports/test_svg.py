"""Inline SVG charts: ticks, gaps, empty charts, stacked bars."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from reports.svg import Series, line_chart, nice_ticks, stacked_bar_chart

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
