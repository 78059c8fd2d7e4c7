"""`rlpipe report A B`: two synthetic runs overlaid on one page, checked against their own tables and manifests.

Every value is read back from the drawn SVG (a point's tooltip, a band's pixel extent mapped back through the
chart's axis) and compared with numbers computed here from the runs' Parquet files and eval manifests, not
with the report's own collected data.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli.inspect import main as inspect_main
from reports.compare import build_comparison, write_comparison
from reports.html import read_config, write_report
from reports.svg import BOTTOM, HEIGHT, TOP
from storage.failure import record_failure
from storage.layout import RunLayout, StageInstance
from storage.run import Run
from tests.reports.test_report import CHROMIUM, assert_chart_text_fits, chromium, rendered_layout
from tests.support.synthetic_runs import SyntheticSpec, write_synthetic_run

SVG = "{http://www.w3.org/2000/svg}"
RUNS = ("alpha", "beta")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compare")
    write_synthetic_run(str(root), SyntheticSpec(run_id="alpha", iterations=3, test_prompts=5, seed=11))
    write_synthetic_run(str(root), SyntheticSpec(run_id="beta", iterations=2, test_prompts=5, seed=12,
                                                 steps_per_iteration=3))
    write_synthetic_run(str(root), SyntheticSpec(run_id="gamma", iterations=1, seed=13))  # not compared
    return root


def chart(html: str, chart_id: str) -> ET.Element:
    svg = re.search(rf'<svg[^>]*id="{re.escape(chart_id)}".*?</svg>', html, re.S)
    assert svg, chart_id
    return ET.fromstring(svg.group(0))


def tooltips(svg: ET.Element, series: str) -> dict[str, float]:
    """x label -> value of each point of `series`, read from the points' tooltips."""
    values = {}
    for circle in svg.iter(f"{SVG}circle"):
        name, _, rest = circle.find(f"{SVG}title").text.partition(" at ")
        if name == series:
            label, _, value = rest.rpartition(": ")
            values[label] = float(value)
    return values


def unit_value(y_px: float) -> float:
    """A y pixel of a chart with a 0..1 axis back to its value."""
    return (HEIGHT - BOTTOM - y_px) / (HEIGHT - BOTTOM - TOP)


def eval_intervals(root: Path, run: str) -> dict[str, tuple[float, float]]:
    """x label -> (low, high) of pass@1's interval, from the run's eval manifests on disk."""
    intervals = {}
    for path in sorted((root / "runs" / run).glob("**/eval.parquet.manifest.json")):
        summary = json.loads(path.read_text())["metrics"]["synthetic"]
        label = "base" if path.parent.name == "base" else str(int(path.parent.name.removeprefix("iter=")))
        intervals[label] = (summary["pass@1_ci_low"], summary["pass@1_ci_high"])
    return intervals


def test_two_runs_share_every_chart_each_with_its_own_series(root: Path) -> None:
    html = build_comparison(str(root), list(RUNS))
    assert 'data-runs="alpha beta"' in html and "gamma" not in html
    reward = chart(html, "chart-reward")
    for run in RUNS:
        expected = {}
        for path in sorted((root / "runs" / run).glob("iter=*/scores.parquet")):
            expected[str(int(path.parent.name.removeprefix("iter=")))] = pc.mean(pq.read_table(path)["reward"]).as_py()
        assert len(expected) == {"alpha": 3, "beta": 2}[run]
        assert tooltips(reward, run) == pytest.approx(expected, abs=5e-4)  # tooltips carry 4 significant digits
    lines = {p.get("data-series") for p in reward.iter(f"{SVG}polyline")}
    assert lines == {"alpha", "alpha solve rate", "beta", "beta solve rate"}
    kl = chart(html, "chart-kl")
    beta_steps = pq.read_table(root / "runs/beta/iter=0001/train_metrics.parquet").to_pylist()
    points = tooltips(kl, "beta")
    assert len(points) == 6 and all(points[str(r["step"])] == pytest.approx(r["approx_kl"], rel=1e-3)
                                    for r in beta_steps)
    for chart_id in ("chart-pass-at-1-synthetic", "chart-pass-at-4-synthetic", "chart-length", "chart-stage-time"):
        assert {e.get("data-series") for e in chart(html, chart_id).iter() if e.get("data-series")} >= (
            set(RUNS) if chart_id != "chart-stage-time" else {"generate", "train"})


def test_pass_at_k_bands_span_each_runs_recorded_interval(root: Path) -> None:
    svg = chart(build_comparison(str(root), list(RUNS)), "chart-pass-at-1-synthetic")
    for run in RUNS:
        bands = [p for p in svg.iter(f"{SVG}polygon") if p.get("data-series") == run]
        assert len(bands) == 1 and bands[0].get("class") == "band"
        corners = [tuple(map(float, point.split(","))) for point in bands[0].get("points").split()]
        intervals = eval_intervals(root, run)
        assert len(corners) == 2 * len(intervals) == 2 * {"alpha": 4, "beta": 3}[run]  # base + each iteration
        upper, lower = corners[: len(intervals)], corners[len(intervals):][::-1]
        for (label, (low, high)), (_, y_high), (_, y_low) in zip(intervals.items(), upper, lower, strict=True):
            assert unit_value(y_high) == pytest.approx(high, abs=1e-3), (run, label)
            assert unit_value(y_low) == pytest.approx(low, abs=1e-3), (run, label)
            assert low <= tooltips(svg, run)[label] <= high


def test_single_run_report_draws_pass_at_k_with_its_interval(root: Path) -> None:
    html = Path(write_report(layout := RunLayout.create(str(root), "alpha"), read_config(layout))).read_text()
    svg = chart(html, "chart-pass-at-k")
    bands = {p.get("data-series"): p for p in svg.iter(f"{SVG}polygon")}
    assert set(bands) == {"pass@1", "pass@4"}  # greedy accuracy has no interval
    extent = [unit_value(float(point.split(",")[1])) for point in bands["pass@1"].get("points").split()]
    intervals = eval_intervals(root, "alpha").values()
    assert max(extent) == pytest.approx(max(high for _, high in intervals), abs=1e-3)
    assert min(extent) == pytest.approx(min(low for low, _ in intervals), abs=1e-3)


def test_report_command_compares_several_runs(root: Path, tmp_path: Path) -> None:
    assert inspect_main(["report", "alpha", "beta", "--root", str(root)]) == 0
    written = root / "reports" / "compare-alpha-vs-beta.html"
    assert written.read_text().startswith("<!DOCTYPE html>") and "chart-pass-at-1-synthetic" in written.read_text()
    out = tmp_path / "both.html"
    assert inspect_main(["report", "beta", "alpha", "--root", str(root), "--out", str(out)]) == 0
    assert 'data-runs="beta alpha"' in out.read_text()
    assert inspect_main(["report", "alpha", "alpha", "--root", str(root)]) == 2


def test_a_run_that_is_not_under_the_root_is_one_line_and_nothing_written(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/your-own-job.md's `rlpipe report default mine mine-360m` where mine-360m was refused before it started
    (its model not downloadable): the runs missing and the runs there, on one line; no page, no run directory."""
    before = sorted(str(path) for path in root.rglob("*"))
    for runs in (["alpha", "nope", "beta", "nope2"], ["nope"]):
        assert inspect_main(["report", *runs, "--root", str(root)]) == 2
        message = capsys.readouterr().err
        missing = ", ".join(run for run in runs if run.startswith("nope"))
        assert message == (f"no run {missing} under {root} (no runs/<run>/config.yaml); "
                           "runs there: alpha, beta, gamma\n")
    assert sorted(str(path) for path in root.rglob("*")) == before


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian `chromium` (make system-deps installs it)")
def test_comparison_renders_in_headless_chromium(root: Path, tmp_path: Path) -> None:
    url = Path(write_comparison(str(root), list(RUNS))).as_uri()
    dom = chromium(["--dump-dom", url], tmp_path / "profile").stdout
    rendered = dict(re.findall(r'<svg[^>]*id="([^"]+)"[^>]*data-rendered="([^"]+)"', dom))
    assert sorted(rendered) == sorted(["chart-reward", "chart-pass-at-1-synthetic", "chart-pass-at-4-synthetic",
                                       "chart-length", "chart-kl", "chart-stage-time"])
    for chart_id, value in rendered.items():
        width, height, marks = map(int, re.fullmatch(r"(\d+)x(\d+):(\d+)", value).groups())
        declared = re.search(rf'<svg[^>]*id="{chart_id}"[^>]*height="(\d+)"', dom).group(1)
        assert (width, height) == (560, int(declared)) and height >= 280 and marks > 0, (chart_id, value)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian `chromium` (make system-deps installs it)")
def test_comparison_marks_a_run_that_failed_at_its_first_stage(tmp_path: Path) -> None:
    """The issue's `rlpipe report A B C`: a run that failed at its first stage reads, as rendered, as failed, at
    which stage and why, beside a run that finished (its steps counted); legends show every run's name whole."""
    write_synthetic_run(str(tmp_path), SyntheticSpec(run_id="mine-360m", iterations=2, seed=3, skipped_iterations=(1,)))
    failed = Run.start(SyntheticSpec(run_id="mine-360m-broken").config(str(tmp_path)), str(tmp_path)).layout
    record_failure(failed, StageInstance("prompts"), 2, "data/train.jsonl row 3: field `prompt` is missing")
    page = rendered_layout(write_comparison(str(tmp_path), ["mine-360m", "mine-360m-broken"]), tmp_path)
    rows = {line.split("\t")[0]: line for line in page["text"].splitlines()
            if "\t" in line and line.startswith("mine-360m")}  # the table's rows, one line each
    assert "failed" not in rows["mine-360m"] and "2 taken, 1 skipped (iteration 1:" in rows["mine-360m"]
    assert "failed at prompts (exit code 2): data/train.jsonl row 3: field `prompt` is missing" in page["text"]
    for chart in page["charts"]:
        assert_chart_text_fits(chart)
    reward = next(chart for chart in page["charts"] if chart["id"] == "chart-reward")
    assert [t["text"] for t in reward["texts"] if t["kind"] == "legend"] == [
        "mine-360m", "mine-360m solve rate", "mine-360m-broken", "mine-360m-broken solve rate"]
