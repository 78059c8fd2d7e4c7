"""`rlpipe export`: a run's rollouts as datasets for other tools (TRL's SFT and DPO trainers, verl, `datasets`).

The rows a `--where` filters are the catalog's samples view of one run (a rollout with its score, batch row and
checkpoints) with its prompt's `dataset`, `messages`, `reward_spec`, `metadata` (EXPORT_SQL); DuckDB parses the
expression as an expression (relation `filter`), so a statement or a typo is one error naming DuckDB's reason.
Formats: `sft` one row per selected rollout, `messages` = prompt + response (TRL's conversational language
modeling); `dpo` every pair of selected rollouts of one group (run, iteration, round, prompt) with different
rewards, higher as `chosen` (TRL's conversational preference); `verl` each selected rollout's prompt once, in
verl's RL Parquet (read back by stages/data/formats.py's verl format: the reward spec survives, so does the
prompt id); `hf` the selected rows, every column, as `save_to_disk` writes them. A multi-turn rollout's response
is its whole conversation (assistant turns and the tool or feedback messages between them), not its last turn.
Output is a local folder: written under a temporary name beside it and renamed, with `export.json` (source run,
iterations, query, rows, the content hashes of the tables read) inside, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import data_source_of
from schemas.errors import InputError
from schemas.tables import ROLLOUT_KEY
from storage.catalog import Catalog
from storage.fs import temporary_prefix
from storage.manifest import code_version, git_commit

EXPORT_FORMATS = ("sft", "dpo", "verl", "hf")
# Without --where: SFT learns from the passing responses (every test passed; a custom reward above 0), the others
# take every row (DPO needs the failures for its rejected side).
DEFAULT_WHERE = {"sft": "status = 'ok'", "dpo": "true", "verl": "true", "hf": "true"}
DATA_FILE = "train.parquet"  # what `load_dataset(folder)` reads as the train split, verl as data.train_files
MANIFEST_FILE = "export.json"
# The rows `--where` sees: every samples-view column plus the prompt's (docs/usage.md lists them).
EXPORT_SQL = """
SELECT s.*, p.dataset, p.messages, p.reward_spec, p.metadata
FROM samples s
LEFT JOIN (SELECT run_id, prompt_id, dataset, messages, reward_spec, metadata FROM prompts WHERE split = 'train') p
  ON p.run_id = s.run_id AND p.prompt_id = s.prompt_id
WHERE s.run_id = $run
"""
ORDER = "iteration, round, prompt_id, sample_idx"
GROUP = ROLLOUT_KEY[:-1]  # a prompt's samples of one generation round: (run_id, iteration, round, prompt_id)
CODE_KINDS = ("code_tests", "code_stdio", "code_call")


@dataclass(frozen=True)
class Export:
    """What an export wrote: the folder, its format, the rows written and the manifest."""

    out: Path
    format: str
    rows: int
    manifest: dict[str, Any]


def export_run(root: str, run_id: str, fmt: str, out: str | Path, where: str | None = None,
               overwrite: bool = False) -> Export:
    """Export run `run_id`'s rollouts selected by `where` (default DEFAULT_WHERE[fmt]) as `fmt` into folder `out`."""
    if fmt not in EXPORT_FORMATS:
        raise InputError(f"--format {fmt!r}: expected one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out).expanduser().absolute()
    if out.exists() and not overwrite:
        raise InputError(f"--out {out} exists: choose another path or pass --overwrite")
    where = (where or DEFAULT_WHERE[fmt]).strip()
    with Catalog(root, [run_id]) as catalog:
        if not catalog.listing.all_entries():
            raise InputError(f"run {run_id} does not exist under {catalog.root} (no outputs with a manifest)")
        selected = _select(catalog, run_id, where)
        inputs = {f"{e.where}/{e.name}": e.manifest.sha256 for name in ("prompts", "rollouts", "scores", "batch")
                  for e in catalog.entries(name)}
    rows = selected.to_pylist()
    missing = sorted({row["prompt_id"] for row in rows if row["messages"] is None})
    if missing:
        raise InputError(f"run {run_id}: prompt {missing[0]} of a selected rollout is not in the run's prompts table")
    table = WRITERS[fmt](rows) if fmt != "hf" else selected
    if table.num_rows == 0:  # only DPO can select rows and still have nothing to write
        raise InputError(f"--where {where!r} selects {len(rows)} rollouts of run {run_id}, but no group has two "
                         "with different rewards: no chosen/rejected pair")
    iterations = sorted({row["iteration"] for row in rows})
    manifest = {
        "format": fmt, "run_id": run_id, "root": catalog.root, "iterations": iterations, "where": where,
        "query": f"SELECT * FROM ({EXPORT_SQL.strip().replace('$run', repr(run_id))}) WHERE {where} ORDER BY {ORDER}",
        "selected_rollouts": len(rows), "rows": table.num_rows, "columns": table.column_names,
        "inputs": {label: sha for label, sha in sorted(inputs.items())
                   if label.startswith("run/") or any(label.startswith(f"iter={i:04d}") for i in iterations)},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code_version": code_version(), "git_commit": git_commit(),
    }
    _write_atomically(out, table, fmt, manifest, overwrite)
    return Export(out, fmt, table.num_rows, manifest)


def _select(catalog: Catalog, run_id: str, where: str) -> pa.Table:
    """The run's rows that `where` selects, in key order; a bad expression or an empty result is an InputError."""
    relation = catalog.con.sql(EXPORT_SQL, params={"run": run_id})
    total = relation.aggregate("count(*)").fetchall()[0][0]
    if total == 0:
        raise InputError(f"run {run_id} has no rollouts yet")
    try:
        selected = relation.filter(where).order(ORDER).to_arrow_table()
    except duckdb.Error as error:
        reason = " ".join(str(error).split("\n\n")[0].split())  # DuckDB's first paragraph, on one line
        raise InputError(f"--where {where!r} is not a valid SQL condition on the export's columns: {reason}") from None
    if selected.num_rows == 0:
        raise InputError(f"--where {where!r} selects no rollout of run {run_id} ({total} rollouts in all)")
    return selected


# --- formats -------------------------------------------------------------------------------------------------


def prompt_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in json.loads(row["messages"])]


def response_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The rollout's side of the chat: its whole conversation (multi-turn), else one assistant message."""
    if row.get("conversation"):
        return [{"role": m["role"], "content": m["content"]} for m in json.loads(row["conversation"])]
    return [{"role": "assistant", "content": row["response_text"]}]


def _key(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in ROLLOUT_KEY}


def sft_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist([
        {"messages": prompt_messages(row) + response_messages(row), **_key(row), "reward": row["reward"]}
        for row in rows
    ])


def dpo_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Every (higher, lower) reward pair of one group's selected rollouts; equal rewards make no pair."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[name] for name in GROUP), []).append(row)
    pairs = []
    for members in groups.values():
        for chosen in members:
            for rejected in members:
                if (chosen["reward"] is None or rejected["reward"] is None
                        or chosen["reward"] <= rejected["reward"]):
                    continue
                pairs.append({
                    "prompt": prompt_messages(chosen), "chosen": response_messages(chosen),
                    "rejected": response_messages(rejected), **{name: chosen[name] for name in GROUP},
                    "chosen_sample_idx": chosen["sample_idx"], "rejected_sample_idx": rejected["sample_idx"],
                    "chosen_reward": chosen["reward"], "rejected_reward": rejected["reward"],
                })
    if not pairs:
        return pa.table({"prompt": pa.array([], pa.string())})
    return pa.Table.from_pylist(pairs)


def verl_ground_truth(spec: dict[str, Any], metadata: dict[str, Any]) -> dict[str, str | None]:
    """verl's reward_model {style, ground_truth} (text, as verl's own files hold it) of an rlpipe reward spec, in
    the spelling stages/data/formats.py reads back as the same spec."""
    kind, style = spec.get("kind"), "rule"
    if kind == "math":
        truth: Any = spec["answer"]
    elif kind == "code_stdio":
        truth = {"inputs": spec["inputs"], "outputs": spec["outputs"]}
    elif kind == "code_call":
        truth = {"fn_name": spec["fn_name"], "inputs": spec["inputs"], "outputs": spec["outputs"]}
    elif kind == "code_tests":
        truth = spec  # no verl spelling for check(candidate) tests: rlpipe's own spec, which the reader knows
    else:  # custom: scored by the user's functions from verl's columns; a verl row's own ground truth if it had one
        style = "model"
        truth = metadata["ground_truth"] if "ground_truth" in metadata else spec.get("columns")
    return {"style": style, "ground_truth": truth if truth is None or isinstance(truth, str) else json.dumps(truth)}


def verl_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Each selected rollout's prompt once (first appearance), in verl's RL Parquet columns."""
    seen: set[str] = set()
    prompts = []
    for row in rows:
        if row["prompt_id"] in seen:
            continue
        seen.add(row["prompt_id"])
        spec, metadata = json.loads(row["reward_spec"]), json.loads(row["metadata"] or "{}")
        kind = spec.get("kind")
        # A verl row's extra_info as it came (a custom spec's columns hold it: the prompt id survives)
        extra_info = metadata.get("extra_info") or {"index": len(prompts), "split": "train"}
        prompts.append({
            "data_source": data_source_of(metadata, row["dataset"]),
            "prompt": prompt_messages(row),
            "ability": metadata.get("ability") or ("code" if kind in CODE_KINDS else kind),
            "reward_model": verl_ground_truth(spec, metadata),
            "extra_info": extra_info,
        })
    return pa.Table.from_pylist(prompts)


WRITERS = {"sft": sft_table, "dpo": dpo_table, "verl": verl_table}


# --- writing -------------------------------------------------------------------------------------------------


def _write_atomically(out: Path, table: pa.Table, fmt: str, manifest: dict[str, Any], overwrite: bool) -> None:
    """Write into a temporary sibling folder, then rename it to `out` (replacing `out` only with `overwrite`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=temporary_prefix(str(out)), dir=out.parent))
    try:
        if fmt == "hf":
            import datasets

            datasets.disable_progress_bars()  # the command prints one line, not a bar per shard
            datasets.Dataset(table).save_to_disk(str(temporary))
        else:
            pq.write_table(table, temporary / DATA_FILE, compression="zstd")
        (temporary / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
        if overwrite and out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(temporary, out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            os.replace(temporary, out)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
