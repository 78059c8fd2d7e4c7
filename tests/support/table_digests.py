"""A finished run's fingerprint: one digest per table, to show that a change left every table of a run as it was.

The tables are enumerated from the registry (what each scheduled stage instance writes, dynamic-sampling
rounds included), not from a list of paths. A table whose manifest vouches for its bytes is digested by the
sha256 of the file (checked against the manifest): byte-identical or not. A table whose manifest says
`deterministic: false` and names `nondeterministic_columns` (score's measured `sandbox_seconds`, train's
per-step `seconds`) is digested without them: the rest, read with pyarrow and combined into one chunk, as an
Arrow IPC stream. A table that says `deterministic: false` without naming columns cannot be compared at all
and is refused. Parquet files carry the writer's version, so a pyarrow upgrade changes every file digest.

    python -m tests.support.table_digests ROOT RUN_ID            # print the digests
    python -m tests.support.table_digests ROOT RUN_ID --write tests/fixtures/tiny_run_digests.json \
        --command "rlpipe run --config tests/e2e/tiny.yaml"      # record them, with the commit and the date
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages.registry import RUN_STAGES, STAGES, Output, instance, iteration_stages, outputs_of, round_inputs
from storage.layout import BASE
from storage.manifest import Manifest, read_manifest, sha256_file
from storage.run import Run


def run_tables(run: Run) -> list[Output]:
    """Every table the run's scheduled stage instances write, run-level stages first, then iteration by iteration
    (round 0, then each dynamic-sampling round the batch was built from)."""
    targets = [instance(stage, BASE) for stage in RUN_STAGES]
    for k in range(run.config.iterations):
        targets += [instance(stage, k) for stage in iteration_stages(run.config, k)]
    tables = [output for target in targets for output in outputs_of(target) if output.kind == "table"]
    for k in range(run.config.iterations):  # the rounds r >= 1 of generate and score, as their readers see them
        for reader in [spec.name for spec in STAGES.values() if spec.reads_rounds]:
            tables += [output for output in round_inputs(run, reader, k).values() if output not in tables]
    return tables


def table_digest(run: Run, manifest: Manifest) -> dict[str, object]:
    """{"sha256": ...} of the file, or, for a table with declared nondeterministic columns, {"arrow_sha256": ...,
    "without": [those columns]} of the rest."""
    where = Path(manifest.path).name
    if sha256_file(run.fs, manifest.path) != manifest.sha256:
        raise ValueError(f"{manifest.path}: the file's sha256 is not its manifest's")
    columns = sorted(manifest.metrics.get("nondeterministic_columns", []))
    if manifest.metrics.get("deterministic") is False and not columns:
        raise ValueError(f"{where}: its manifest says deterministic: false and names no columns; nothing to compare")
    if not columns:
        return {"sha256": manifest.sha256}
    with run.fs.open(manifest.path, "rb") as handle:
        kept = pq.read_table(handle).drop_columns(columns).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, kept.schema) as writer:
        writer.write_table(kept)
    return {"arrow_sha256": hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest(), "without": columns}


def run_digests(run: Run) -> dict[str, dict[str, object]]:
    """Relative path of each table in the run directory -> its digest (`table_digest`)."""
    digests = {}
    for output in run_tables(run):
        manifest = read_manifest(run.fs, output.manifest_path(run.layout))
        if manifest is None:
            raise ValueError(f"{output.path(run.layout)} has no manifest: the run is not finished")
        relative = output.path(run.layout).removeprefix(run.layout.run_dir).lstrip("/")
        digests[relative] = table_digest(run, manifest)
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root")
    parser.add_argument("run_id")
    parser.add_argument("--write", type=Path, help="record the digests in this JSON file")
    parser.add_argument("--command", default="", help="the command that made the run (recorded with --write)")
    args = parser.parse_args()
    digests = run_digests(Run.open(args.root, args.run_id))
    if args.write is None:
        print(json.dumps(digests, indent=2))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    record = {"commit": commit.stdout.strip(), "date": datetime.now(UTC).strftime("%Y-%m-%d"),
              "command": args.command, "pyarrow": pa.__version__, "tables": digests}
    args.write.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
