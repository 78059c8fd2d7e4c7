"""The HTML report: its numbers (through the catalog), self-containment, and rendering in headless Chromium."""

from __future__ import annotations

import hashlib
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli.inspect import main as inspect_main
from reports.html import collect, describe_steps, optimizer_steps, pass_at_k, read_config, write_report
from storage.catalog import Catalog
from storage.failure import record_failure
from storage.layout import RunLayout, StageInstance
from tests.support.synthetic_runs import SyntheticSpec, write_synthetic_run

CHART_IDS = ("chart-reward", "chart-pass-at-k", "chart-length", "chart-truncated", "chart-clip", "chart-kl",
             "chart-entropy", "chart-status", "chart-stage-time")


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("report")
    write_synthetic_run(str(root), SyntheticSpec(run_id="rep", iterations=4, train_prompts=12, prompts_per_iteration=6,
                                                 steps_per_iteration=3, seed=7))
    write_synthetic_run(str(root), SyntheticSpec(run_id="other", iterations=1, seed=8))  # must not leak in
    return root


def test_pass_at_k_matches_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 2) == 0.0


def test_optimizer_steps_are_told_apart_taken_skipped_and_not_applied() -> None:
    """The issue's case: two iterations whose steps were both skipped took no optimizer step, not 2."""
    nan = float("nan")
    both_skipped = [{"iteration": 0, "skipped": True, "grad_norm": nan}, {"iteration": 1, "skipped": True,
                                                                          "grad_norm": nan}]
    assert optimizer_steps(both_skipped) == (0, [0, 1], 0)
    assert describe_steps(both_skipped) == ("0 taken, 2 skipped (iterations 0, 1: no kept sample with a nonzero "
                                            "advantage)")
    mixed = [{"iteration": 0, "skipped": False, "grad_norm": 0.7}, {"iteration": 0, "skipped": False, "grad_norm": nan},
             {"iteration": 1, "skipped": True, "grad_norm": nan}, {"iteration": 2, "skipped": False, "grad_norm": 1.1}]
    assert describe_steps(mixed) == ("2 taken, 1 skipped (iteration 1: no kept sample with a nonzero advantage), "
                                     "1 not applied (gradient not finite)")


def test_collect_numbers_match_the_tables(run_root: Path) -> None:
    layout = RunLayout.create(str(run_root), "rep")
    with Catalog(str(run_root), ["rep"]) as catalog:
        data = collect(catalog, "rep", read_config(layout))
    run_dir = run_root / "runs/rep"
    assert data.iterations == [0, 1, 2, 3] and data.last_iteration == 3
    for row in data.reward:
        scores = pq.read_table(run_dir / f"iter={row['iteration']:04d}/scores.parquet")
        assert row["mean_reward"] == pytest.approx(pc.mean(scores.column("reward")).as_py())
        ok = pc.sum(pc.equal(scores.column("status"), "ok")).as_py()
        assert row["solve_rate"] == pytest.approx(ok / scores.num_rows)
        assert sum(data.statuses[row["iteration"]].values()) == scores.num_rows == 24
    assert [r["iteration"] for r in data.evaluation] == [-1, 0, 1, 2, 3]
    for row in data.evaluation:
        name = "base/eval.parquet" if row["iteration"] < 0 else f"iter={row['iteration']:04d}/eval.parquet"
        ev = pq.read_table(run_dir / name).to_pylist()
        by_prompt: dict[str, list[bool]] = {}
        for r in ev:
            if r["mode"] == "sampled":
                by_prompt.setdefault(r["prompt_id"], []).append(r["correct"])
        for k in (1, 4):
            expected = sum(pass_at_k(len(c), sum(c), k) for c in by_prompt.values()) / len(by_prompt)
            assert row[f"pass@{k}"] == pytest.approx(expected)
        greedy = [r["correct"] for r in ev if r["mode"] == "greedy"]
        assert row["greedy"] == pytest.approx(sum(greedy) / len(greedy))
    rollouts = pq.read_table(run_dir / "iter=0002/rollouts.parquet")
    assert data.lengths[2]["mean"] == pytest.approx(pc.mean(rollouts.column("num_tokens")).as_py())
    assert len(data.train) == 4 * 3 and [r["step"] for r in data.train] == list(range(12))
    manifest = json.loads((run_dir / "iter=0001/rollouts.parquet.manifest.json").read_text())
    assert data.stage_seconds["1"]["generate"] == pytest.approx(manifest["seconds"])
    assert set(data.stage_seconds["run"]) == {"prompts", "base_model", "evaluate_base"}
    assert set(data.stage_seconds["3"]) == {"generate", "score", "advantage", "train", "evaluate"}
    best, worst = [r["reward"] for r in data.best], [r["reward"] for r in data.worst]
    last = pq.read_table(run_dir / "iter=0003/scores.parquet").column("reward")
    assert best == sorted(best, reverse=True) and best[0] == pc.max(last).as_py()
    assert worst == sorted(worst) and worst[0] == pc.min(last).as_py()
    assert all(r["iteration"] == 3 and r["run_id"] == "rep" for r in data.best + data.worst)


def test_report_is_one_self_contained_file(run_root: Path) -> None:
    path = write_report(layout := RunLayout.create(str(run_root), "rep"), read_config(layout))
    assert path == f"{run_root}/runs/rep/report.html"
    html = Path(path).read_text()
    assert re.findall(r'(?:src|href)\s*=\s*"(?!#)', html) == []  # no scripts, styles or images from elsewhere
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html
    for chart in CHART_IDS:
        assert f'id="{chart}"' in html
    assert html.count('class="series"') >= 10 and html.count('class="bar"') >= 4 * 3


def test_partial_run_still_reports(tmp_path: Path) -> None:
    write_synthetic_run(str(tmp_path), SyntheticSpec(run_id="young", iterations=1, with_checkpoints=False,
                                                     with_eval=False))
    html = Path(write_report(layout := RunLayout.create(str(tmp_path), "young"), read_config(layout))).read_text()
    assert html.count("no data yet") == 4  # pass@k, clip, KL, entropy: nothing trained or evaluated yet
    assert 'id="chart-reward"' in html and "<polyline" not in html.split('id="chart-reward"')[1].split("</svg>")[0]


def test_report_command(run_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy.html"
    assert inspect_main(["report", "rep", "--root", str(run_root), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")


# --- headless Chromium: the page renders, and the plots are drawn -------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, check=True)


# Added to a copy of a page by the tests only: once laid out, the page's text as rendered (`innerText`) and each
# chart's size and text boxes (relative to the chart), as JSON in a <pre id="layout">.
LAYOUT_SCRIPT = """<script>
window.addEventListener('load', function () {
  var charts = Array.from(document.querySelectorAll('svg.chart')).map(function (svg) {
    var box = svg.getBoundingClientRect();
    var texts = Array.from(svg.querySelectorAll('text')).map(function (t) {
      var r = t.getBoundingClientRect();
      return {text: t.childNodes[0] ? t.childNodes[0].nodeValue : '',
              kind: t.getAttribute('class') || t.parentNode.getAttribute('class'),
              left: r.left - box.left, top: r.top - box.top, right: r.right - box.left, bottom: r.bottom - box.top};
    });
    return {id: svg.id, width: box.width, height: box.height, texts: texts};
  });
  var out = document.createElement('pre');
  out.id = 'layout';
  out.textContent = JSON.stringify({text: document.body.innerText, charts: charts});
  document.body.appendChild(out);
});
</script>"""


def rendered_layout(html_path: str, tmp_path: Path) -> dict:
    """Render a copy of the page in headless Chromium: {"text": the page as rendered, "charts": [{id, width,
    height, texts: [{text, kind, left, top, right, bottom}]}]}."""
    page = tmp_path / "layout.html"
    page.write_text(Path(html_path).read_text().replace("</body>", LAYOUT_SCRIPT + "</body>"))
    dom = chromium(["--dump-dom", page.as_uri()], tmp_path / "profile-layout").stdout
    return json.loads(html.unescape(re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S).group(1)))


def assert_chart_text_fits(chart: dict) -> None:
    """Every text of a chart lies inside it, and no two overlap (a legend name cut or over a neighbour, a tick
    label under the axis label)."""
    texts = [t for t in chart["texts"] if t["text"].strip()]
    for t in texts:
        assert -0.5 <= t["left"] and t["right"] <= chart["width"] + 0.5, (chart["id"], t)
        assert -0.5 <= t["top"] and t["bottom"] <= chart["height"] + 0.5, (chart["id"], t)
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            overlap_x = min(a["right"], b["right"]) - max(a["left"], b["left"])
            overlap_y = min(a["bottom"], b["bottom"]) - max(a["top"], b["top"])
            assert overlap_x <= 1 or overlap_y <= 3, (chart["id"], a, b)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian `chromium` (make system-deps installs it)")
def test_charts_render_in_headless_chromium(run_root: Path, tmp_path: Path) -> None:
    url = Path(write_report(layout := RunLayout.create(str(run_root), "rep"), read_config(layout))).as_uri()
    dom = chromium(["--dump-dom", url], tmp_path / "profile-dom").stdout
    # The page's script marks each chart with its laid-out size and number of drawn marks on `load`.
    rendered = dict(re.findall(r'<svg[^>]*id="([^"]+)"[^>]*data-rendered="([^"]+)"', dom))
    assert sorted(rendered) == sorted(CHART_IDS)
    for chart, value in rendered.items():
        width, height, marks = map(int, re.fullmatch(r"(\d+)x(\d+):(\d+)", value).groups())
        declared = re.search(rf'<svg[^>]*id="{chart}"[^>]*height="(\d+)"', dom).group(1)
        assert width == 560 and height == int(declared) >= 280 and marks > 0, (chart, value)
    assert 'data-charts-rendered="9"' in dom

    image_module = pytest.importorskip("PIL.Image", reason="pillow (installed with vllm) reads the screenshot")
    screenshot = tmp_path / "report.png"
    chromium([f"--screenshot={screenshot}", "--window-size=1280,2600", url], tmp_path / "profile-shot")
    image = image_module.open(screenshot).convert("RGB")
    assert image.size == (1280, 2600)
    colours = image.getcolors(maxcolors=1 << 20)
    counts = {rgb: n for n, rgb in colours}

    def pixels_near(rgb: tuple[int, int, int], tolerance: int = 12) -> int:
        return sum(n for c, n in counts.items() if all(abs(a - b) <= tolerance for a, b in zip(c, rgb, strict=True)))

    assert pixels_near((0x00, 0x72, 0xB2)) > 2000  # the first series' blue: lines, markers, legends
    assert pixels_near((0x00, 0x9E, 0x73)) > 2000  # status "ok" bars (green)
    assert pixels_near((0xD5, 0x5E, 0x00)) > 2000  # status "fail" bars (vermillion)


def test_evaluation_shows_each_datasets_recorded_bootstrap_intervals(tmp_path: Path) -> None:
    """The held-out table shows each checkpoint's pass@k per held-out dataset, with the 95% interval its
    evaluate stage recorded for that dataset (here: the stage's own `aggregate`, on a synthetic run whose
    test prompts are split into two datasets)."""
    from stages.evaluation.metrics import aggregate

    layout = write_synthetic_run(str(tmp_path), SyntheticSpec(run_id="ci", iterations=1, test_prompts=6, seed=3))
    run_dir = tmp_path / "runs/ci"
    prompt_ids = sorted({r["prompt_id"] for r in pq.read_table(run_dir / "base/eval.parquet").to_pylist()})
    dataset_of = {pid: "easy" if i % 2 else "hard" for i, pid in enumerate(prompt_ids)}
    recorded: dict[tuple[int, str], dict] = {}
    for iteration, name in ((-1, "base/eval.parquet"), (0, "iter=0000/eval.parquet")):
        table = pq.read_table(run_dir / name)
        rows = [r | {"dataset": dataset_of[r["prompt_id"]]} for r in table.to_pylist()]
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), run_dir / name)
        path = run_dir / f"{name}.manifest.json"
        manifest = json.loads(path.read_text())
        manifest["metrics"] = {d: aggregate([r for r in rows if r["dataset"] == d], [1, 4]) for d in ("easy", "hard")}
        manifest["bytes"] = (run_dir / name).stat().st_size
        manifest["sha256"] = hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
        path.write_text(json.dumps(manifest))
        recorded |= {(iteration, d): summary for d, summary in manifest["metrics"].items()}
    with Catalog(str(tmp_path), ["ci"]) as catalog:
        data = collect(catalog, "ci", read_config(layout))
    assert [(r["iteration"], r["dataset"]) for r in data.evaluation] == [(-1, "easy"), (-1, "hard"), (0, "easy"),
                                                                        (0, "hard")]
    for row in data.evaluation:
        summary = recorded[(row["iteration"], row["dataset"])]
        assert row["prompts"] == summary["prompts"] == 3
        for k in (1, 4):
            assert row[f"pass@{k}"] == pytest.approx(summary[f"pass@{k}"])
            assert row[f"pass@{k}_ci"] == (summary[f"pass@{k}_ci_low"], summary[f"pass@{k}_ci_high"])
    html = (Path(write_report(layout := RunLayout.create(str(tmp_path), "ci"), read_config(layout)))).read_text()
    for row in data.evaluation:
        low, high = row["pass@1_ci"]
        cell = f"{row['pass@1']:.1%} <span class='meta'>[{low:.1%}, {high:.1%}]"
        assert f"<td>{row['dataset']}</td><td class='num'>{cell}" in html


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian `chromium` (make system-deps installs it)")
def test_rendered_report_says_the_run_failed_and_its_steps_were_skipped(tmp_path: Path) -> None:
    """As a reader sees it in a browser: a run whose both train steps were skipped (no kept group) and that then
    failed says so at the top, with the stage and the reason; its charts' text fits and nothing overlaps."""
    layout = write_synthetic_run(str(tmp_path), SyntheticSpec(run_id="stuck", iterations=2, skipped_iterations=(0, 1),
                                                              seed=5))
    record_failure(layout, StageInstance("evaluate", 1), 1, "RuntimeError: CUDA out of memory")
    page = rendered_layout(write_report(layout, read_config(layout)), tmp_path)
    text = page["text"]
    assert "Run failed at evaluate iter=1 (exit code 1): RuntimeError: CUDA out of memory" in text
    assert re.search(r"optimizer steps taken\s+0\s+skipped or not applied\s+2\s", text), text[:800]
    assert "optimizer steps: 0 taken, 2 skipped (iterations 0, 1: no kept sample with a nonzero advantage)" in text
    charts = {chart["id"]: chart for chart in page["charts"]}
    assert [t["text"] for t in charts["chart-kl"]["texts"]][-1] == "no data yet"  # nothing was trained
    for chart in charts.values():
        assert_chart_text_fits(chart)
    legend = [t["text"] for t in charts["chart-pass-at-k"]["texts"] if t["kind"] == "legend"]
    assert legend == ["pass@1", "pass@4", "greedy accuracy"]


def test_multi_turn_figures_read_n_a_where_they_do_not_apply() -> None:
    """Tool mode: turns, calls per answer and error rate, no retries (n/a, not 0.0); feedback mode: no tool
    figures, solved after retry over the answers that got a retry; n/a where there is nothing to count."""
    from reports.html import ReportData, multi_turn_cells, render
    from schemas.config import load_config

    tool = {"prompts": 4, "mean_turns": 1.75, "tool_calls_per_answer": 1.25, "tool_error_rate": 0.2}
    assert multi_turn_cells(tool, "tool") == ["1.75", "1.250", "0.200", "n/a"]
    assert multi_turn_cells({"prompts": 4, "mean_turns": 1.0, "tool_calls_per_answer": 0.0}, "tool") == [
        "1.00", "0.000", "n/a", "n/a"]  # no call: no error rate
    feedback = {"prompts": 4, "mean_turns": 1.5, "tool_calls_per_answer": 0.0, "retried_answers": 3,
                "solved_after_retry": 2 / 3}
    assert multi_turn_cells(feedback, "feedback") == ["1.50", "n/a", "n/a", "0.667 (3 retried)"]
    assert multi_turn_cells({**feedback, "retried_answers": 0, "solved_after_retry": None}, "feedback")[3] == (
        "n/a (0 retried)")
    assert multi_turn_cells({"prompts": 4}, "tool") == ["–"] * 4  # an evaluation from before multi-turn figures
    data = ReportData(run_id="mt", root="/r", config=load_config(None, ["generate.multi_turn.mode=feedback"]),
                      evaluation=[{"iteration": -1, "dataset": "pytasks", "greedy": 0.5, "prompts": 4,
                                   "pass@1": 0.25, "summary": feedback}])
    html = render(data)
    assert "<th>solved after retry</th>" in html
    assert ("<td class='num'>1.50</td><td class='num'>n/a</td><td class='num'>n/a</td>"
            "<td class='num'>0.667 (3 retried)</td></tr>") in html
    data.config = load_config(None, [])
    assert "solved after retry" not in render(data)  # single-turn runs keep their table
