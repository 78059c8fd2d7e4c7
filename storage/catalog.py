"""The catalog: one DuckDB connection with a SQL view per table over every run and iteration under a root.

    prompts, rollouts, scores, batch, train_metrics, eval    one view per table, all runs and iterations
    samples       a rollout joined with its score, its batch row (advantage) and its checkpoints
    manifests     every manifest the catalog found (`shared_from`: the run a fork's output is shared with);
                  checkpoints   the checkpoint manifests
    reward_functions  one row per score.rewards term per score / evaluate stage instance (its manifest's
                  `reward_functions`): function, fn, weight, calls, errors, error_frac, values (calls with
                  a value), mean (over those), first_error

Views carry the table's columns plus `iter`, the Hive partition of the file's directory (`iter=0003` -> 3;
`base/` -> -1); the run-level prompts view adds `run_id` from the directory. `scores` and `eval` (and so
`samples`) also carry the fields of the row's prompt a user groups by, joined from the run's prompts on
(run_id, prompt_id) in the view, so the Parquet tables are unchanged: `data_source` (verl's; a row without one,
e.g. pytasks or HumanEval, gets its prompt's `dataset`, as a verl reward function is given) and `ability`
(verl's; null where the row has none). Only files whose manifest exists
and whose size matches it are read (a Parquet file without one is partial or abandoned), so the catalog lists
manifests first and hands DuckDB an explicit file list; `Catalog.skipped` says what was left out and why.
On S3 the s3fs file system is registered with DuckDB, because DuckDB's httpfs extension would have to be
downloaded. A fork's shared tables (`rlpipe fork`, storage/sharing.py) are its own files (hard links) on a local
root, and on S3 the origin's files its manifests name (`Manifest.by_reference`): either way a shared table's rows
are read once per run that has it, each time with that run's `run_id`.
Views are plain SQL over `read_parquet([...])`: nothing loads at open; `refresh()` picks up
outputs written since.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import duckdb
import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from schemas.tables import TABLES
from storage.fs import filesystem, is_remote, join, normalize_root
from storage.layout import BASE, instance_name
from storage.manifest import Manifest

TABLE_VIEWS = ("prompts", "rollouts", "scores", "batch", "train_metrics", "eval")
ROLLOUT_KEY = ("run_id", "iteration", "round", "prompt_id", "sample_idx")
# Views that carry their prompt's fields, and the split their prompts are in; each field's SQL over a prompts row.
PROMPT_FIELD_VIEWS = {"scores": "train", "eval": "test"}
PROMPT_FIELDS = {
    "data_source": "coalesce(json_extract_string(metadata, '$.data_source'), dataset)",
    "ability": "json_extract_string(metadata, '$.ability')",
}

# A manifest's location relative to `<root>/runs/` says what it describes. Table names are matched
# generically (\w+), so a table added later gets a view without a change here. Dynamic-sampling rounds
# (`iter=NNNN/round=RR/`) are rows of the same views (every row carries its `round`).
_TABLE_MANIFEST = re.compile(
    r"^(?P<run>[^/]+)/(?:(?P<dir>base|iter=(?P<iter>\d+))/(?:round=(?P<round>\d+)/)?)?"
    r"(?P<table>\w+)\.parquet\.manifest\.json$"
)
_CHECKPOINT_MANIFEST = re.compile(r"^(?P<run>[^/]+)/checkpoints/(?P<dir>base|iter=(?P<iter>\d+))/manifest\.json$")
_TABLE_FILE = re.compile(r"^(?P<run>[^/]+)/(?:(?:base|iter=\d+)/(?:round=\d+/)?)?\w+\.parquet$")
_REJECTED_FILE = re.compile(
    r"^(?P<run>[^/]+)/(?:(?:base|iter=\d+)/(?:round=\d+/)?)?(?P<table>\w+)\.rejected\.parquet$"
)


@dataclass(frozen=True)
class CatalogEntry:
    """One output the catalog knows: where it is now, and its manifest."""

    name: str  # table name, or "checkpoint"
    run_id: str
    iteration: int | None  # BASE (-1) for base/ and checkpoints/base, None for run-level tables (prompts)
    url: str  # where the file is now (DuckDB-readable: a local path or s3://...); a checkpoint's manifest
    manifest: Manifest
    problem: str | None = None  # set for a table whose file is lost or no longer the manifest's size
    round_idx: int = 0  # generation round of a dynamic-sampling round's table (iter=NNNN/round=RR/)

    @property
    def label(self) -> str:
        return f"{self.run_id}/{self.where}/{self.name}"

    @property
    def files_url(self) -> str:
        """Where the output's bytes are: the table file, or the checkpoint's directory (the origin's, for a fork's
        checkpoint shared by reference)."""
        if self.name != "checkpoint":
            return self.url
        return self.manifest.path if self.manifest.by_reference else self.url.removesuffix("/manifest.json")

    @property
    def where(self) -> str:
        """The output's directory inside the run: "run" (run-level), "base", "iter=NNNN" or
        "iter=NNNN/round=RR" (an extra generation round)."""
        if self.iteration is None:
            return "run"
        return instance_name(self.iteration, self.round_idx)


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str


@dataclass
class Listing:
    tables: dict[str, list[CatalogEntry]] = field(default_factory=dict)
    checkpoints: list[CatalogEntry] = field(default_factory=list)
    damaged: list[CatalogEntry] = field(default_factory=list)  # manifests whose table file is lost or changed
    skipped: list[Skipped] = field(default_factory=list)
    forks: set[str] = field(default_factory=set)  # runs that share outputs with another (`rlpipe fork`)

    def all_entries(self) -> list[CatalogEntry]:
        return [entry for entries in self.tables.values() for entry in entries] + self.checkpoints


def _url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The path as DuckDB (and fsspec) want it: local paths as they are, object-store keys with protocol."""
    if isinstance(fs, LocalFileSystem) or "://" in path:
        return path
    protocol = fs.protocol[0] if isinstance(fs.protocol, tuple | list) else fs.protocol
    return f"{protocol}://{path}"


def _strip(fs: fsspec.AbstractFileSystem, path: str) -> str:
    return path if isinstance(fs, LocalFileSystem) else fs._strip_protocol(path)


def _find(fs: fsspec.AbstractFileSystem, directory: str) -> dict[str, dict[str, Any]]:
    """path -> {"size": bytes} of every file under `directory`. Locally os.walk: fsspec's local `find` costs
    ~0.3 ms per file in path normalisation, which is most of opening a long history."""
    if not isinstance(fs, LocalFileSystem):
        return fs.find(directory, detail=True)
    if not os.path.isdir(directory):
        raise FileNotFoundError(directory)
    found = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            path = f"{parent}/{name}"
            try:
                found[path] = {"size": os.stat(path).st_size}
            except FileNotFoundError:  # removed while we listed (a stage replacing its output)
                continue
    return found


def _stat(fs: fsspec.AbstractFileSystem, path: str) -> dict[str, Any] | None:
    """{"size": bytes} of one file outside the listed runs (a fork's share by reference), or None when it is gone."""
    try:
        return {"size": fs.size(path)}
    except FileNotFoundError:
        return None


def _cat(fs: fsspec.AbstractFileSystem, paths: list[str]) -> dict[str, bytes]:
    """path -> contents; concurrent GETs on S3 (fsspec's batched cat), plain reads locally."""
    if not paths:
        return {}
    if not isinstance(fs, LocalFileSystem):
        return fs.cat(paths, on_error="omit")
    contents = {}
    for path in paths:
        try:
            with open(path, "rb") as handle:
                contents[path] = handle.read()
        except FileNotFoundError:  # removed while we listed: read as "unreadable", i.e. skipped
            continue
    return contents


def _iteration(match: re.Match[str]) -> int | None:
    if match.group("dir") is None:
        return None
    return BASE if match.group("dir") == "base" else int(match.group("iter"))


def list_outputs(root: str, run_ids: list[str] | None = None) -> Listing:
    """Every finished output under `root` (optionally only some runs): manifests first, then their files.

    One recursive listing of `runs/` (one paginated LIST on S3), one batched read of the manifests.
    """
    root = normalize_root(root)
    fs = filesystem(root)
    runs_dir = _strip(fs, join(root, "runs"))
    listing = Listing()
    found: dict[str, dict[str, Any]] = {}
    if not isinstance(fs, LocalFileSystem):
        # The S3 file system object is shared in the process (storage/fs.py) and caches listings: outputs
        # written since (by stage processes, other machines) would be missed.
        fs.invalidate_cache()
    # With run ids given, only their directories are listed (a shared root may hold many runs).
    for directory in [f"{runs_dir}/{run_id}" for run_id in run_ids] if run_ids else [runs_dir]:
        try:
            found.update(_find(fs, directory))
        except FileNotFoundError:
            continue
    relative = {path[len(runs_dir) + 1 :]: info for path, info in found.items() if path.startswith(runs_dir + "/")}
    manifest_paths: dict[str, tuple[str, re.Match[str]]] = {}
    for rel in relative:
        match = _TABLE_MANIFEST.match(rel) or _CHECKPOINT_MANIFEST.match(rel)
        if match:
            manifest_paths[f"{runs_dir}/{rel}"] = (rel, match)
    contents = _cat(fs, list(manifest_paths))
    listed_with_manifest: set[str] = set()
    for full, (rel, match) in sorted(manifest_paths.items()):
        try:
            manifest = Manifest.from_json(contents[full], _url(fs, full))
        except (KeyError, ValueError) as error:
            listing.skipped.append(Skipped(_url(fs, full), f"unreadable manifest: {error}"))
            continue
        run_id, iteration = match.group("run"), _iteration(match)
        if manifest.shared_from:
            listing.forks.add(run_id)
        if "table" not in match.groupdict():
            listing.checkpoints.append(CatalogEntry("checkpoint", run_id, iteration, _url(fs, full), manifest))
            continue
        data_rel = rel.removesuffix(".manifest.json")
        listed_with_manifest.add(data_rel)
        # A table manifest describes the file beside it, or, shared by reference, the origin's file it names
        data = _strip(fs, manifest.path) if manifest.by_reference else f"{runs_dir}/{data_rel}"
        info = found.get(data) or (_stat(fs, data) if manifest.by_reference else None)
        entry = CatalogEntry(match.group("table"), run_id, iteration, _url(fs, data), manifest,
                             round_idx=int(match.group("round") or 0))
        # That file must be present, and with the recorded size. Anything else is a lost file or one rewritten
        # after its manifest: not read, and named by the lineage check.
        if info is None:
            entry = replace(entry, problem="missing: the manifest's file is gone (lost output)")
        elif int(info.get("size", -1)) != manifest.bytes:
            entry = replace(entry, problem=f"modified: size {info.get('size')} differs from its manifest's "
                                           f"{manifest.bytes} bytes")
        if entry.problem:
            listing.damaged.append(entry)
            listing.skipped.append(Skipped(entry.url, entry.problem))
            continue
        listing.tables.setdefault(entry.name, []).append(entry)
    for rel in sorted(relative):
        if _TABLE_FILE.match(rel) and rel not in listed_with_manifest:
            listing.skipped.append(Skipped(_url(fs, f"{runs_dir}/{rel}"), "no manifest (partial or abandoned output)"))
        elif rejected := _REJECTED_FILE.match(rel):
            listing.skipped.append(Skipped(
                _url(fs, f"{runs_dir}/{rel}"),
                f"rejected by its data contract (see {rejected.group('table')}.parquet.validation.json)",
            ))
    return listing


def _quote(text: str) -> str:
    """`text` inside a single-quoted SQL string literal."""
    return text.replace("'", "''")


def _sql_list(urls: list[str]) -> str:
    return "[" + ", ".join(f"'{_quote(url)}'" for url in urls) + "]"


def _union_by_name(entries: list[CatalogEntry]) -> str:
    """Match columns by name across files only when their schema versions differ: with one version,
    DuckDB binds the view from one file's footer instead of reading every file's (the slow part of
    opening a long history)."""
    return ", union_by_name = true" if len({e.manifest.schema for e in entries}) > 1 else ""


def _fork_entry_sql(name: str, entry: CatalogEntry) -> str:
    """One file of a fork's table with the fork's run id: a shared file's rows carry the run that computed them,
    and so do the fork's own tables built from them (advantage keeps the rollouts' keys)."""
    has_run_id = name in TABLES and "run_id" in TABLES[name].schema.names
    run_id = f"'{_quote(entry.run_id)}' AS run_id"
    columns = f"* REPLACE ({run_id})" if has_run_id else f"*, {run_id}"
    iteration = "NULL" if entry.iteration is None else entry.iteration
    return (f"SELECT {columns}, CAST({iteration} AS INTEGER) AS iter "
            f"FROM read_parquet('{_quote(entry.url)}', hive_partitioning = false)")


def _table_view_sql(name: str, entries: list[CatalogEntry], empty_relation: str | None,
                    forks: set[str] | None = None) -> str:
    """SELECT over a table's files with the `iter` partition column (and `run_id` for run-level tables); the files
    of `forks` one by one, with their run id from the directory (`_fork_entry_sql`)."""
    if not entries:
        if empty_relation is None:
            raise ValueError(f"no files and no schema for table {name}")
        extra = ", CAST(NULL AS VARCHAR) AS run_id" if name == "prompts" else ""
        return f"SELECT *{extra}, CAST(NULL AS INTEGER) AS iter FROM {empty_relation}"
    forked = [e for e in entries if e.run_id in (forks or set())]
    entries = [e for e in entries if e.run_id not in (forks or set())]
    partitioned = [e for e in entries if e.iteration is not None and e.iteration != BASE and not e.round_idx]
    rounds = [e for e in entries if e.round_idx]
    base = [e for e in entries if e.iteration == BASE]
    run_level = [e for e in entries if e.iteration is None]
    parts = []
    if partitioned:
        # Hive partitioning gives `iter` from the directory and prunes files on `WHERE iter = ...`;
        # the directory name is zero-padded ("0003"), so the type is given, not guessed.
        parts.append(
            f"SELECT * FROM read_parquet({_sql_list([e.url for e in partitioned])}, hive_partitioning = true, "
            f"hive_types = {{'iter': INTEGER}}{_union_by_name(partitioned)})"
        )
    if rounds:
        # Tables of dynamic-sampling rounds sit one directory deeper (iter=NNNN/round=RR/): Hive partitioning
        # would reject the mix of depths, and `round` is a column of the rows already. `iter` per file.
        cases = " ".join(f"WHEN '{_quote(e.url)}' THEN {e.iteration}" for e in rounds)
        parts.append(
            f"SELECT * EXCLUDE (filename), CAST(CASE filename {cases} END AS INTEGER) AS iter "
            f"FROM read_parquet({_sql_list([e.url for e in rounds])}, filename = true, hive_partitioning = false"
            f"{_union_by_name(rounds)})"
        )
    if base:  # base/ has no key=value directory: Hive partitioning would reject the mix, so it is its own part
        parts.append(
            f"SELECT *, CAST({BASE} AS INTEGER) AS iter "
            f"FROM read_parquet({_sql_list([e.url for e in base])}{_union_by_name(base)})"
        )
    if run_level:
        # A run-level table (prompts) carries no run_id: it comes from the run directory, per file.
        cases = " ".join(f"WHEN '{_quote(e.url)}' THEN '{_quote(e.run_id)}'" for e in run_level)
        urls = _sql_list([e.url for e in run_level])
        has_run_id = name in TABLES and "run_id" in TABLES[name].schema.names
        run_id = "" if has_run_id else f", CASE filename {cases} END AS run_id"
        parts.append(
            f"SELECT * EXCLUDE (filename){run_id}, CAST(NULL AS INTEGER) AS iter "
            f"FROM read_parquet({urls}, filename = true{_union_by_name(run_level)})"
        )
    parts += [_fork_entry_sql(name, entry) for entry in forked]
    return "\nUNION ALL BY NAME\n".join(parts)


def _with_prompt_fields(sql: str, split: str) -> str:
    """`sql`'s rows with their prompt's PROMPT_FIELDS, from the same run's prompts of `split` (a prompt is in
    one split, so the join adds no row; a row whose prompt is not in the catalog gets nulls)."""
    fields = ", ".join(f"{expression} AS {name}" for name, expression in PROMPT_FIELDS.items())
    return (f"SELECT t.*, {', '.join(f'p.{name}' for name in PROMPT_FIELDS)} FROM ({sql}) t\n"
            f"LEFT JOIN (SELECT run_id, prompt_id, {fields} FROM prompts WHERE split = '{split}') p\n"
            "  ON p.run_id = t.run_id AND p.prompt_id = t.prompt_id")


REWARD_FUNCTION_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("iter", pa.int32()), ("round", pa.int32()), ("stage", pa.string()),
    ("function", pa.string()), ("fn", pa.string()), ("weight", pa.float64()), ("calls", pa.int64()),
    ("errors", pa.int64()), ("error_frac", pa.float64()), ("values", pa.int64()), ("mean", pa.float64()),
    ("first_error", pa.string()),
])


def _reward_function_rows(entries: list[CatalogEntry]) -> pa.Table:
    """The reward_functions view: each term of score.rewards in each scores / eval table's manifest, a row a
    SQL user groups by `function` (`SELECT function, avg(mean), sum(errors) / sum(calls) ... GROUP BY 1`)."""
    rows = [
        {"run_id": entry.run_id, "iter": entry.iteration, "round": entry.round_idx, "stage": entry.manifest.stage,
         "function": name, **{key: figures.get(key) for key in REWARD_FUNCTION_SCHEMA.names[5:]}}
        for entry in entries if entry.name in ("scores", "eval")
        for name, figures in (entry.manifest.metrics.get("reward_functions") or {}).items()
    ]
    return pa.Table.from_pylist(rows, schema=REWARD_FUNCTION_SCHEMA)


def _manifest_rows(entries: list[CatalogEntry]) -> pa.Table:
    rows = []
    for entry in entries:
        m = entry.manifest
        rows.append({
            "run_id": entry.run_id,
            "iter": entry.iteration,
            "round": entry.round_idx,
            "name": entry.name,
            "checkpoint": entry.where if entry.name == "checkpoint" else None,
            "stage": m.stage,
            "kind": m.kind,
            "url": entry.url,
            "recorded_path": m.path,
            "sha256": m.sha256,
            "bytes": m.bytes,
            "rows": m.rows,
            "schema": m.schema,
            "key": m.key,
            "inputs": json.dumps(m.inputs, sort_keys=True),
            "input_batch": m.inputs.get("batch"),
            "input_policy": m.inputs.get("policy"),
            "config_hash": m.config_hash,
            "code_version": m.code_version,
            "git_commit": m.git_commit,
            "host": m.host,
            "started_at": m.started_at,
            "ended_at": m.ended_at,
            "seconds": m.seconds,
            "shared_from": (m.shared_from or {}).get("run"),
            # Checkpoint manifests hold per-file hashes in `metrics["files"]` (base model): left out, it is bulk.
            "metrics": json.dumps({k: v for k, v in m.metrics.items() if k != "files"}, sort_keys=True, default=str),
        })
    schema = pa.schema([
        ("run_id", pa.string()), ("iter", pa.int32()), ("round", pa.int32()), ("name", pa.string()),
        ("checkpoint", pa.string()),
        ("stage", pa.string()), ("kind", pa.string()), ("url", pa.string()), ("recorded_path", pa.string()),
        ("sha256", pa.string()), ("bytes", pa.int64()), ("rows", pa.int64()), ("schema", pa.string()),
        ("key", pa.string()), ("inputs", pa.string()), ("input_batch", pa.string()), ("input_policy", pa.string()),
        ("config_hash", pa.string()), ("code_version", pa.string()), ("git_commit", pa.string()),
        ("host", pa.string()), ("started_at", pa.string()), ("ended_at", pa.string()), ("seconds", pa.float64()),
        ("shared_from", pa.string()), ("metrics", pa.string()),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


# The samples view: one row per rollout with everything that happened to it. `generated_by` is the
# checkpoint whose content hash the rollout carries; `trained_into` is the checkpoint of the same
# iteration whose manifest names, as its `batch` input, the hash of the batch file holding this row (so
# a checkpoint trained on an older, since-rewritten batch does not count). Whether the row moved the
# weights is `kept` (a dropped row was in the batch table but not in the loss).
_SAMPLES_SQL = """
SELECT r.*,
       s.reward, s.passed, s.total, s.status, s.tests, s.code, s.sandbox_seconds, s.data_source, s.ability,
       b.shaped_reward, b.advantage, b.kept, b.drop_reason, b.group_size, b.group_mean, b.group_std,
       g.checkpoint AS generated_by,
       t.checkpoint AS trained_into, t.sha256 AS trained_into_sha256
FROM rollouts r
LEFT JOIN scores s
  ON s.run_id = r.run_id AND s.iteration = r.iteration AND s.round = r.round
 AND s.prompt_id = r.prompt_id AND s.sample_idx = r.sample_idx
LEFT JOIN batch b
  ON b.run_id = r.run_id AND b.iteration = r.iteration AND b.round = r.round
 AND b.prompt_id = r.prompt_id AND b.sample_idx = r.sample_idx
LEFT JOIN (
    SELECT DISTINCT ON (run_id, sha256) run_id, sha256, checkpoint FROM checkpoints ORDER BY run_id, sha256, iter
) g ON g.run_id = r.run_id AND g.sha256 = r.policy_version
LEFT JOIN (
    SELECT c.run_id, c.iter, c.checkpoint, c.sha256
    FROM checkpoints c
    JOIN manifests m ON m.run_id = c.run_id AND m.iter = c.iter AND m.name = 'batch' AND m.sha256 = c.input_batch
) t ON t.run_id = r.run_id AND t.iter = r.iteration
"""


class Catalog:
    """A DuckDB connection with the run history as views. Use as a context manager, or call `close()`."""

    def __init__(self, root: str, run_ids: list[str] | None = None, threads: int | None = None) -> None:
        self.root = normalize_root(root)
        self.run_ids = run_ids
        self.con = duckdb.connect(":memory:")
        if threads:
            self.con.execute(f"SET threads = {int(threads)}")
        if is_remote(self.root):
            self.con.register_filesystem(filesystem(self.root))
        self.listing = Listing()
        self.refresh()

    @property
    def skipped(self) -> list[Skipped]:
        return self.listing.skipped

    def entries(self, name: str) -> list[CatalogEntry]:
        return self.listing.tables.get(name, [])

    def refresh(self) -> None:
        """List the root again and (re)create every view."""
        self.listing = list_outputs(self.root, self.run_ids)
        names = list(TABLE_VIEWS) + sorted(set(self.listing.tables) - set(TABLE_VIEWS))
        for name in names:
            empty = None
            if name in TABLES and not self.entries(name):  # no files yet: an empty relation of the schema
                empty = f"_empty_{name}"
                self.con.register(empty, TABLES[name].schema.empty_table())
            sql = _table_view_sql(name, self.entries(name), empty, self.listing.forks)
            if name in PROMPT_FIELD_VIEWS:  # after prompts (the first view), which it joins
                sql = _with_prompt_fields(sql, PROMPT_FIELD_VIEWS[name])
            self.con.execute(f'CREATE OR REPLACE VIEW "{name}" AS {sql}')
        manifests = _manifest_rows(self.listing.all_entries())
        self.con.register("_manifests", manifests)
        self.con.execute("CREATE OR REPLACE VIEW manifests AS SELECT * FROM _manifests")
        self.con.execute("CREATE OR REPLACE VIEW checkpoints AS SELECT * FROM _manifests WHERE name = 'checkpoint'")
        self.con.register("_reward_functions", _reward_function_rows(self.listing.all_entries()))
        self.con.execute("CREATE OR REPLACE VIEW reward_functions AS SELECT * FROM _reward_functions")
        self.con.execute(f"CREATE OR REPLACE VIEW samples AS {_SAMPLES_SQL}")

    def sql(self, query: str, params: list[Any] | dict[str, Any] | None = None) -> duckdb.DuckDBPyRelation:
        return self.con.sql(query, params=params)

    def arrow(self, query: str, params: list[Any] | dict[str, Any] | None = None) -> pa.Table:
        """The result of `query` as an Arrow table."""
        return self.con.sql(query, params=params).to_arrow_table()

    def rows(self, query: str, params: list[Any] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        return self.arrow(query, params).to_pylist()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
