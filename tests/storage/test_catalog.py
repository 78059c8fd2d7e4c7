"""The catalog: views over every run and iteration, only finished outputs, the samples join, local and S3;
and the `rlpipe query` / `rlpipe show` commands built on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli.inspect import main as inspect_main
from flows.cli.inspect import run_query, sample_story, shortest_unique_prefixes
from schemas.tables import TABLES
from storage.catalog import TABLE_VIEWS, Catalog
from storage.fs import filesystem
from storage.layout import RunLayout, manifest_path_for
from storage.manifest import read_manifest, write_manifest
from storage.tables import write_table
from tests.support.ports import free_port
from tests.support.processes import spawn_tied
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec, prompt_id_for, write_synthetic_run


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two synthetic runs: `a` with 3 iterations, `b` with 2 (and 3 samples per prompt)."""
    root = tmp_path_factory.mktemp("history")
    write_synthetic_run(str(root), run_id="a", iterations=3, seed=1)
    write_synthetic_run(str(root), run_id="b", iterations=2, seed=2, n_samples=3)
    return root


def table_files(root: Path, run: str, name: str) -> list[Path]:
    return sorted((root / "runs" / run).glob(f"*/{name}.parquet"))


def reward_by_iteration_direct(root: Path, run: str) -> dict[int, float]:
    result = {}
    for path in table_files(root, run, "scores"):
        table = pq.read_table(path)
        result[table.column("iteration")[0].as_py()] = pc.mean(table.column("reward")).as_py()
    return result


def test_every_view_covers_all_runs_and_iterations(history: Path) -> None:
    with Catalog(str(history)) as catalog:
        counts = {name: catalog.rows(f"SELECT count(*) AS n FROM {name}")[0]["n"] for name in TABLE_VIEWS}
        # a: 3 iterations x 4 prompts x 4 samples; b: 2 x 4 x 3
        assert counts["rollouts"] == counts["scores"] == counts["batch"] == 48 + 24
        assert counts["train_metrics"] == (3 + 2) * 2
        assert counts["prompts"] == 2 * (8 + 3)
        # eval: base + every iteration, 3 test prompts x (1 greedy + 4 sampled)
        assert counts["eval"] == (4 + 3) * 15
        iters = catalog.rows("SELECT run_id, iter, min(iteration) AS lo, max(iteration) AS hi FROM eval "
                             "GROUP BY ALL ORDER BY ALL")
        assert [(r["run_id"], r["iter"]) for r in iters] == [
            ("a", -1), ("a", 0), ("a", 1), ("a", 2), ("b", -1), ("b", 0), ("b", 1)]
        assert all(r["iter"] == r["lo"] == r["hi"] for r in iters)  # the base evaluation is iteration -1
        prompts = catalog.rows("SELECT run_id, count(*) AS n FROM prompts GROUP BY ALL ORDER BY ALL")
        assert prompts == [{"run_id": "a", "n": 11}, {"run_id": "b", "n": 11}]
        assert catalog.skipped == []


def test_reward_by_iteration_matches_the_files(history: Path) -> None:
    with Catalog(str(history)) as catalog:
        rows = catalog.rows("SELECT run_id, iteration, avg(reward) AS r FROM scores GROUP BY ALL ORDER BY ALL")
    for run in ("a", "b"):
        direct = reward_by_iteration_direct(history, run)
        got = {r["iteration"]: r["r"] for r in rows if r["run_id"] == run}
        assert got == pytest.approx(direct)


def test_samples_join_score_advantage_and_checkpoints(history: Path) -> None:
    with Catalog(str(history), ["a"]) as catalog:
        samples = catalog.arrow("SELECT * FROM samples ORDER BY iteration, round, prompt_id, sample_idx")
        scores = catalog.arrow("SELECT * FROM scores ORDER BY iteration, round, prompt_id, sample_idx")
        batch = catalog.arrow("SELECT * FROM batch ORDER BY iteration, round, prompt_id, sample_idx")
        checkpoints = {r["checkpoint"]: r["sha256"] for r in catalog.rows("SELECT * FROM checkpoints")}
    assert samples.num_rows == 48
    assert samples.column("reward").to_pylist() == scores.column("reward").to_pylist()
    assert samples.column("advantage").to_pylist() == batch.column("advantage").to_pylist()
    assert samples.column("tests").to_pylist() == scores.column("tests").to_pylist()
    by_iteration = {}
    for row in samples.select(["iteration", "generated_by", "trained_into", "trained_into_sha256",
                               "policy_version"]).to_pylist():
        by_iteration.setdefault(row["iteration"], set()).add(
            (row["generated_by"], row["trained_into"], row["trained_into_sha256"], row["policy_version"]))
    assert by_iteration[0] == {("base", "iter=0000", checkpoints["iter=0000"], checkpoints["base"])}
    assert by_iteration[2] == {("iter=0001", "iter=0002", checkpoints["iter=0002"], checkpoints["iter=0001"])}


VERL_SOURCES = ("openai/gsm8k", "lighteval/MATH", None)  # prompt i's data_source: i % 3; None: a non-verl row


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose prompts carry verl's data_source and ability, but for every third (e.g. a pytasks row)."""
    root = tmp_path_factory.mktemp("verl")
    write_synthetic_run(str(root), run_id="v", iterations=2, seed=3, data_sources=VERL_SOURCES)
    return root


def source_of(split: str) -> dict[str, str]:
    """prompt_id -> the data_source the catalog should give it: the row's, else its dataset ("synthetic")."""
    return {prompt_id_for(3, i, split): VERL_SOURCES[i % 3] or "synthetic" for i in range(8)}


def mean_by_source(files: list[Path], split: str, value: str) -> dict[str, tuple[int, float]]:
    """(rows, mean of `value`) per data_source, read from the Parquet files with pyarrow, not SQL."""
    groups: dict[str, list[float]] = {}
    for path in files:
        for row in pq.read_table(path).to_pylist():
            groups.setdefault(source_of(split)[row["prompt_id"]], []).append(float(row[value]))
    return {source: (len(values), sum(values) / len(values)) for source, values in groups.items()}


def test_data_source_groups_scores_without_a_join(verl_run: Path) -> None:
    with Catalog(str(verl_run)) as catalog:
        rows = catalog.rows("SELECT data_source, avg(reward) FROM scores GROUP BY 1")  # the query
        counts = catalog.rows("SELECT data_source, ability, count(*) AS n FROM scores GROUP BY ALL ORDER BY ALL")
        samples = catalog.rows("SELECT data_source, count(*) AS n FROM samples GROUP BY 1 ORDER BY 1")
    expected = mean_by_source(table_files(verl_run, "v", "scores"), "train", "reward")
    assert {r["data_source"]: r["avg(reward)"] for r in rows} == pytest.approx(
        {source: mean for source, (_, mean) in expected.items()})
    # iteration 0 trains prompts 0-3, iteration 1 prompts 4-7, 4 samples each: gsm8k 0, 3, 6; MATH 1, 4, 7;
    # the rows without a data_source (2, 5) are grouped by their dataset, and have no ability
    assert counts == [{"data_source": "lighteval/MATH", "ability": "code", "n": 12},
                      {"data_source": "openai/gsm8k", "ability": "code", "n": 12},
                      {"data_source": "synthetic", "ability": None, "n": 8}]
    assert samples == [{"data_source": "lighteval/MATH", "n": 12}, {"data_source": "openai/gsm8k", "n": 12},
                       {"data_source": "synthetic", "n": 8}]
    # the columns are the view's: the table files are as the stages wrote them
    assert "data_source" not in pq.read_schema(table_files(verl_run, "v", "scores")[0]).names


def test_held_out_results_group_by_data_source(verl_run: Path) -> None:
    with Catalog(str(verl_run)) as catalog:
        rows = catalog.rows("SELECT data_source, count(*) AS n, avg(correct::INT) AS accuracy FROM eval "
                            "GROUP BY 1 ORDER BY 1")
    expected = mean_by_source(sorted((verl_run / "runs/v").glob("*/eval.parquet")), "test", "correct")
    # test prompts 0, 1, 2 (one per source), evaluated 3 times (base, iterations 0 and 1) x (1 greedy + 4 sampled)
    assert [(r["data_source"], r["n"]) for r in rows] == [("lighteval/MATH", 15), ("openai/gsm8k", 15),
                                                          ("synthetic", 15)]
    assert {r["data_source"]: r["accuracy"] for r in rows} == pytest.approx(
        {source: mean for source, (_, mean) in expected.items()})


def test_a_run_without_verl_fields_groups_by_dataset(history: Path) -> None:
    with Catalog(str(history)) as catalog:
        rows = catalog.rows("SELECT data_source, ability, count(*) AS n FROM scores GROUP BY ALL")
    assert rows == [{"data_source": "synthetic", "ability": None, "n": 72}]


def copy_root(history: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(history, root)
    return root


def test_only_outputs_with_a_manifest_are_read(history: Path, tmp_path: Path) -> None:
    root = copy_root(history, tmp_path)
    # 1. an abandoned output: a table file whose stage never wrote its manifest
    partial = root / "runs/b/iter=0002/rollouts.parquet"
    partial.parent.mkdir()
    shutil.copy(root / "runs/b/iter=0001/rollouts.parquet", partial)
    # 2. a lost output: the manifest is there, the file is not
    (root / "runs/a/iter=0001/scores.parquet").unlink()
    # 3. a file rewritten after its manifest was written (a hand edit, or a writer that ignores the protocol)
    eval_path = root / "runs/a/iter=0002/eval.parquet"
    pq.write_table(pq.read_table(eval_path).slice(0, 3), eval_path)
    # 4. a table its stage rejected (data contract): kept beside the output for inspection, never read
    shutil.copy(root / "runs/a/iter=0000/batch.parquet", root / "runs/a/iter=0000/batch.rejected.parquet")
    with Catalog(str(root)) as catalog:
        assert catalog.rows("SELECT count(*) AS n FROM rollouts")[0]["n"] == 72  # not 72 + 12
        assert catalog.rows("SELECT count(*) AS n FROM batch")[0]["n"] == 72  # not 72 + 16
        assert catalog.rows("SELECT DISTINCT iteration FROM scores WHERE run_id = 'a' ORDER BY 1") == [
            {"iteration": 0}, {"iteration": 2}]
        assert catalog.rows("SELECT count(*) AS n FROM eval WHERE run_id = 'a' AND iter = 2")[0]["n"] == 0
        reasons = {Path(s.path).relative_to(root).as_posix(): s.reason for s in catalog.skipped}
    assert sorted(reasons) == ["runs/a/iter=0000/batch.rejected.parquet", "runs/a/iter=0001/scores.parquet",
                               "runs/a/iter=0002/eval.parquet", "runs/b/iter=0002/rollouts.parquet"]
    assert reasons["runs/a/iter=0000/batch.rejected.parquet"] == (
        "rejected by its data contract (see batch.parquet.validation.json)")
    assert reasons["runs/b/iter=0002/rollouts.parquet"] == "no manifest (partial or abandoned output)"
    assert reasons["runs/a/iter=0001/scores.parquet"] == "missing: the manifest's file is gone (lost output)"
    assert reasons["runs/a/iter=0002/eval.parquet"].startswith("modified: size")


def test_a_checkpoint_trained_on_an_older_batch_does_not_claim_the_new_one(history: Path, tmp_path: Path) -> None:
    root = copy_root(history, tmp_path)
    layout = RunLayout.create(str(root), "a")
    path = layout.table_path("batch", 1)
    manifest = read_manifest(layout.fs, manifest_path_for(path, "table"))
    table = pq.read_table(path)
    rewritten = table.set_column(table.schema.get_field_index("advantage"), "advantage",
                                 pc.multiply(table.column("advantage"), 2.0))
    written = write_table(layout.fs, path, rewritten, TABLES["batch"])
    manifest.sha256, manifest.bytes = written.sha256, written.bytes
    write_manifest(layout.fs, manifest_path_for(path, "table"), manifest)
    with Catalog(str(root), ["a"]) as catalog:
        trained = catalog.rows("SELECT iteration, count(trained_into) AS n FROM samples GROUP BY 1 ORDER BY 1")
    assert trained == [{"iteration": 0, "n": 16}, {"iteration": 1, "n": 0}, {"iteration": 2, "n": 16}]


def test_empty_root_has_empty_views(tmp_path: Path) -> None:
    with Catalog(str(tmp_path)) as catalog:
        for name in (*TABLE_VIEWS, "samples", "manifests", "checkpoints"):
            assert catalog.rows(f"SELECT count(*) AS n FROM {name}")[0]["n"] == 0
        columns = [r["column_name"] for r in catalog.rows("SELECT column_name FROM (DESCRIBE scores)")]
        assert columns == [*TABLES["scores"].schema.names, "iter", "data_source", "ability"]


def test_query_command_prints_and_writes_csv_and_parquet(history: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    sql = "SELECT run_id, iteration, round(avg(reward), 4) AS r FROM scores GROUP BY ALL ORDER BY ALL"
    csv_path, parquet_path = tmp_path / "out.csv", tmp_path / "out.parquet"
    assert inspect_main(["query", sql, "--root", str(history), "--out", str(csv_path)]) == 0
    printed = capsys.readouterr().out
    assert "5 rows" in printed and "run_id" in printed
    lines = csv_path.read_text().strip().splitlines()
    assert lines[0] == "run_id,iteration,r" and len(lines) == 6
    head, more = run_query(str(history), sql, out=str(parquet_path), max_rows=2)
    assert head.num_rows == 2 and more
    assert pq.read_table(parquet_path).num_rows == 5
    assert inspect_main(["query", "SELECT nope FROM scores", "--root", str(history)]) == 2
    assert "nope" in capsys.readouterr().err


def test_show_tells_one_samples_story(history: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with Catalog(str(history), ["a"]) as catalog:
        row = catalog.rows("SELECT * FROM samples WHERE iteration = 1 AND status = 'fail' "
                           "ORDER BY prompt_id, sample_idx LIMIT 1")[0]
    [story] = sample_story(str(history), "a", 1, row["prompt_id"][:6], row["sample_idx"])
    assert story["reward"] == row["reward"] and story["advantage"] == row["advantage"]
    assert story["generated_by"] == "iter=0000" and story["trained_into"] == "iter=0001"
    assert json.loads(story["messages"])[1]["role"] == "user"
    monkeypatch.setenv("COLUMNS", "160")  # rich wraps at the terminal width
    assert inspect_main(["show", "a", "1", row["prompt_id"][:8], str(row["sample_idx"]), "--root",
                         str(history)]) == 0
    out = capsys.readouterr().out
    for text in ("Complete this Python function", "Here is the solution", "def solve(x)",
                 "assert candidate(0) == 1", "AssertionError", f"{row['passed']}/{row['total']} tests passed",
                 "generated by  iter=0000", "trained into  iter=0001", "status fail"):
        assert text in out, text
    assert inspect_main(["show", "a", "1", "zzzz", "0", "--root", str(history)]) == 2
    assert "no rollouts of a prompt 'zzzz'" in capsys.readouterr().err


def test_show_without_a_sample_lists_the_iterations_samples(history: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scores = pq.read_table(history / "runs" / "a" / "iter=0001" / "scores.parquet").to_pylist()
    batch = {(r["prompt_id"], r["sample_idx"]): r for r in
             pq.read_table(history / "runs" / "a" / "iter=0001" / "batch.parquet").to_pylist()}
    assert inspect_main(["show", "a", "1", "--root", str(history)]) == 0
    out = capsys.readouterr().out
    assert f"run a iteration 1: {len(scores)} samples of {len({r['prompt_id'] for r in scores})} prompts" in out
    listed = [line.split() for line in out.splitlines() if line.strip()[:6] in {r["prompt_id"][:6] for r in scores}]
    expected = sorted(scores, key=lambda r: (r["prompt_id"], r["sample_idx"]))
    assert len(listed) == len(expected)
    for cells, row in zip(listed, expected, strict=True):
        kept = batch[(row["prompt_id"], row["sample_idx"])]
        assert row["prompt_id"].startswith(cells[0]) and int(cells[1]) == row["sample_idx"]
        assert cells[2:4] == [f"{row['reward']:.3f}", row["status"]]
        assert cells[4] == (f"{kept['advantage']:+.3f}" if kept["kept"] else "dropped")
    # one prompt's samples by a prefix, and the command that shows one of them
    prefix = expected[0]["prompt_id"][:6]
    assert inspect_main(["show", "a", "1", prefix, "--root", str(history)]) == 0
    out = capsys.readouterr().out
    assert "4 samples of 1 prompt " in out and f"rlpipe show a 1 {prefix}" in out
    assert inspect_main(["show", "a", "7", "--root", str(history)]) == 2
    assert "run a iteration 7 has no rollouts" in capsys.readouterr().err


def test_shortest_unique_prefixes() -> None:
    assert shortest_unique_prefixes(["abcdef12", "abcdef34", "zz"], least=2) == {
        "abcdef12": "abcdef1", "abcdef34": "abcdef3", "zz": "zz"}
    assert shortest_unique_prefixes(["abcdefgh", "abcdefgh"], least=6) == {"abcdefgh": "abcdef"}


# --- S3 (moto's S3 server: the real S3 API, no AWS) ----------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    boto3 = pytest.importorskip("boto3")
    server = Path(sys.executable).parent / "moto_server"
    if not server.exists():
        pytest.skip("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    process = spawn_tied([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("RLPIPE_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update(RLPIPE_S3_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.create_bucket(Bucket="rlpipe-test")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.2)
        yield endpoint
    finally:
        process.terminate()
        process.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_s3_root_reads_like_a_local_one(s3_endpoint: str, tmp_path: Path) -> None:
    spec = dict(run_id="s", iterations=2, seed=5)
    local = tmp_path / "local"
    write_synthetic_run(str(local), SyntheticSpec(**spec))
    root = "s3://rlpipe-test/history"
    SyntheticRun(root, SyntheticSpec(**spec, base_model_dir=str(tmp_path / "base"))).write()
    fs = filesystem(root)
    # an abandoned output on S3 as well
    fs.pipe_file("rlpipe-test/history/runs/s/iter=0005/scores.parquet",
                 (local / "runs/s/iter=0001/scores.parquet").read_bytes())
    sql = "SELECT iteration, avg(reward) AS r, count(*) AS n FROM scores GROUP BY 1 ORDER BY 1"
    with Catalog(root) as remote, Catalog(str(local)) as here:
        assert remote.rows(sql) == here.rows(sql)
        assert remote.rows("SELECT count(*) AS n FROM samples WHERE trained_into IS NOT NULL")[0]["n"] == 32
        assert remote.rows("SELECT count(*) AS n FROM eval WHERE iter = -1")[0]["n"] == 15
        assert [s.path for s in remote.skipped] == ["s3://rlpipe-test/history/runs/s/iter=0005/scores.parquet"]
        assert remote.entries("scores")[0].url.startswith("s3://rlpipe-test/history/runs/s/")
    # The report goes through the same catalog and lands in the run directory on S3.
    from reports.html import read_config, write_report

    layout = RunLayout.create(root, "s")
    assert write_report(layout, read_config(layout)) == "s3://rlpipe-test/history/runs/s/report.html"
    assert fs.cat_file("rlpipe-test/history/runs/s/report.html").startswith(b"<!DOCTYPE html>")
