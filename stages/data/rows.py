"""One source row -> one prompt: the checks and spec builders every row format shares, and rlpipe's own format.

A format (stages/data/formats.py) reads its fields and builds a `PromptRow` from three parts made here: the
messages (`messages_of`), the reward spec (`code_tests_spec`, `stdio_spec`, `call_spec`, `math_spec`,
`custom_spec`) and the metadata. Every check raises `RowError` naming the field; the reader adds the file and
the line or row, so a user sees exactly where a problem is.

Reward spec kinds (what the score stage runs; stages/sandbox/scoring.py):
- `code_tests`: HumanEval-style `check(candidate)` test code, judged outside the candidate's process;
- `code_stdio`: stdin/stdout cases (strings);
- `code_call`: call-based cases: `fn_name` called with each `inputs[i]` (a list of arguments), the return value
  compared with `outputs[i]` on the trusted side (APPS rule: an expected `[v]` also accepts `v`);
- `math`: a reference answer compared by math-verify;
- `custom`: no built-in verifier; `columns` are what user reward functions receive (score.rewards).

``prompt_id`` is the first 16 hex digits of sha256 over the canonical JSON of ``[messages, reward_spec]``:
the same problem gets the same id in any dataset or file, and any change to what the model sees or how it
is scored gives a new id.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

# Kept short on purpose: SmolLM2-135M follows a short instruction far better than a long one.
CODE_SYSTEM_PROMPT = "You are an expert Python programmer. You write correct, complete code."
CODE_USER_TEMPLATE = (
    "Complete this Python function.\n\n```python\n{prompt}\n```\n\n"
    "Reply with the complete function in one ```python code block."
)
SPLITS = ("train", "test")

_ROLES = frozenset({"system", "user", "assistant"})
FORMATS_HELP = (
    "expected one of: prompt + test + entry_point (HumanEval-style); messages or prompt + test_cases "
    "(or inputs + outputs) (stdin/stdout, or call-based with fn_name); messages or prompt + gt_answer "
    "(or answer) (math); reward_model (verl); input_output (APPS/TACO/LiveCodeBench); text + test_list (MBPP); "
    "or name the format of the source (`{path, format}`)"
)


class RowError(Exception):
    """A problem with one field of one row; the reader adds the file and the line or row."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class PromptRow:
    prompt_id: str
    source_row: int
    messages: list[dict[str, str]]
    reward_spec: dict[str, Any]
    metadata: dict[str, Any]
    split: str | None  # from the file's split column; None when the hash decides


def canonical_json(value: Any) -> str:
    """One spelling per value: sorted keys, no spaces, unicode kept, so hashes do not depend on writers."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_id_of(messages: list[dict[str, str]], reward_spec: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json([messages, reward_spec]).encode()).hexdigest()[:16]


def make_prompt(
    messages: list[dict[str, str]], spec: dict[str, Any], metadata: dict[str, Any], source_row: int,
    split: Any = None,  # noqa: ANN401 - the row's raw split value, checked here
) -> PromptRow:
    if split is not None and split not in SPLITS:
        raise RowError("split", f"must be 'train' or 'test', got {split!r}")
    return PromptRow(prompt_id_of(messages, spec), source_row, messages, spec, metadata, split)


# ---------------------------------------------------------------------------------------------------------
# Fields


def present(row: dict[str, Any], field: str) -> bool:
    return row.get(field) is not None


def string_field(row: dict[str, Any], field: str, label: str | None = None) -> str:
    value = row.get(field)
    if not isinstance(value, str):
        raise RowError(label or field, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(label or field, "is empty")
    return value


def maybe_json(value: Any) -> Any:  # noqa: ANN401 - whatever the text holds
    """Parquet writers often store nested values (messages, test cases) as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def plain(value: Any) -> Any:  # noqa: ANN401 - any JSON value
    """`value` as JSON values (numpy arrays and scalars from Parquet/datasets become lists and numbers)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy array or scalar
        return plain(value.tolist())
    return value


def prompt_of(value: Any, field: str) -> list[dict[str, str]]:  # noqa: ANN401
    """A prompt that is a plain string (one user message, as is) or a conversation (`messages_of`)."""
    if isinstance(value, str) and not isinstance(maybe_json(value), list | dict):
        if not value.strip():
            raise RowError(field, "is empty")
        return [{"role": "user", "content": value}]
    return messages_of(value, field)


def messages_of(value: Any, field: str) -> list[dict[str, str]]:  # noqa: ANN401
    """A conversation from a list of {role, content} or one such object (Colossal-RL)."""
    value = plain(maybe_json(value))
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RowError(field, "must be a non-empty list of {role, content}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise RowError(f"{field}[{i}]", "must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message.get("content")
        if role not in _ROLES:
            raise RowError(f"{field}[{i}].role", f"must be one of {sorted(_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise RowError(f"{field}[{i}].content", f"must be a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    # The model answers as the assistant after the last message, so the conversation must end on the user.
    if messages[-1]["role"] != "user":
        raise RowError(field, f"must end with a user message, ends with {messages[-1]['role']!r}")
    return messages


def string_list(value: Any, field: str) -> list[str]:
    if not isinstance(value, list):
        raise RowError(field, f"must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise RowError(f"{field}[{i}]", f"must be a string, got {type(item).__name__}")
    return value


# ---------------------------------------------------------------------------------------------------------
# Reward specs


def code_messages(prompt: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": CODE_SYSTEM_PROMPT},
        {"role": "user", "content": CODE_USER_TEMPLATE.format(prompt=prompt.strip("\n"))},
    ]


def check_test_code(test: str, field: str = "test") -> None:
    if not re.search(r"^def\s+check\s*\(", test, re.MULTILINE):
        raise RowError(field, "does not define check(candidate)")
    try:
        compile(test, "<test>", "exec")
    except SyntaxError as error:
        raise RowError(field, f"is not valid Python: {error.msg} (line {error.lineno})") from None


def code_tests_spec(prompt: str, test: str, entry_point: str) -> dict[str, Any]:
    """The reward spec of a HumanEval-style problem.

    `preamble` is the prompt text before the `def <entry_point>` line (imports and helper functions such
    as HumanEval/10's `is_palindrome`), so the scorer can run a completion that omits them.
    """
    match = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
    if match is None:
        raise RowError("entry_point", f"no line 'def {entry_point}(' in the prompt")
    check_test_code(test)
    return {
        "kind": "code_tests",
        "entry_point": entry_point,
        "preamble": prompt[: match.start()],
        "test": test,
    }


def stdio_spec(inputs: Any, outputs: Any, prefix: str = "") -> dict[str, Any]:  # noqa: ANN401
    inputs = string_list(inputs, prefix + "inputs")
    outputs = string_list(outputs, prefix + "outputs")
    if not inputs:
        raise RowError(prefix + "inputs", "is empty: a problem needs at least one test")
    if len(inputs) != len(outputs):
        raise RowError(prefix + "outputs", f"has {len(outputs)} items but {prefix}inputs has {len(inputs)}")
    return {"kind": "code_stdio", "inputs": inputs, "outputs": outputs}


def call_spec(fn_name: Any, inputs: Any, outputs: Any, prefix: str = "") -> dict[str, Any]:  # noqa: ANN401
    """Call-based cases: `fn_name(*inputs[i])` must return `outputs[i]` (JSON values)."""
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise RowError(prefix + "fn_name", f"must be a Python identifier, got {fn_name!r}")
    if not isinstance(inputs, list) or not inputs:
        raise RowError(prefix + "inputs", "must be a non-empty list of argument lists")
    for i, arguments in enumerate(inputs):
        if not isinstance(arguments, list):
            raise RowError(f"{prefix}inputs[{i}]", f"must be a list of arguments, got {type(arguments).__name__}")
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        count = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise RowError(prefix + "outputs", f"must be a list as long as {prefix}inputs ({len(inputs)}), got {count}")
    return {"kind": "code_call", "fn_name": fn_name, "inputs": plain(inputs), "outputs": plain(outputs)}


def cases_spec(cases: Any, prefix: str) -> dict[str, Any]:  # noqa: ANN401 - a test-case object
    """stdin/stdout or call-based cases from `{inputs, outputs}` (+ `fn_name`: call-based)."""
    cases = maybe_json(cases)
    if not isinstance(cases, dict):
        raise RowError(prefix.rstrip("."), "must be an object with 'inputs' and 'outputs'")
    if cases.get("fn_name") is not None:
        return call_spec(cases["fn_name"], plain(cases.get("inputs")), plain(cases.get("outputs")), prefix)
    return stdio_spec(cases.get("inputs"), cases.get("outputs"), prefix)


def math_spec(value: Any, field: str) -> dict[str, Any]:  # noqa: ANN401
    # Numbers are accepted (many math sets store 42, not "42"); bool is not a number here.
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise RowError(field, f"must be a string or a number, got {type(value).__name__}")
    answer = str(value).strip()
    if not answer:
        raise RowError(field, "is empty")
    return {"kind": "math", "answer": answer}


def custom_spec(columns: dict[str, Any]) -> dict[str, Any]:
    """No built-in verifier: user reward functions (score.rewards) score it from `columns`."""
    return {"kind": "custom", "columns": plain(columns)}


# ---------------------------------------------------------------------------------------------------------
# rlpipe's own format (and Colossal-RL's, a subset of it)

# Fields each kind consumes: never copied into metadata.
_CODE_FIELDS = {"prompt", "test", "entry_point", "task_id", "canonical_solution"}
_STDIO_FIELDS = {"messages", "prompt", "test_cases", "inputs", "outputs"}
_MATH_FIELDS = {"messages", "prompt", "gt_answer", "answer"}


def scalar_metadata(row: dict[str, Any], used: set[str]) -> dict[str, Any]:
    """`task_id` and every scalar field the format does not use (a `family` groups problems for the
    evaluation's bootstrap intervals)."""
    metadata = {"task_id": row["task_id"]} if present(row, "task_id") else {}
    for key, value in row.items():
        if key not in used and key != "split" and isinstance(value, str | int | float | bool):
            metadata[key] = value
    return metadata


def _conversation(row: dict[str, Any]) -> list[dict[str, str]]:
    if not present(row, "messages"):
        return [{"role": "user", "content": string_field(row, "prompt")}]
    return messages_of(row["messages"], "messages")


def rlpipe_prompt(row: dict[str, Any], source_row: int) -> PromptRow:
    """rlpipe's format, detected per row by its (non-null) fields: HumanEval-style, stdin/stdout (or
    call-based when the cases name `fn_name`), or math."""
    if present(row, "test") or present(row, "entry_point"):
        prompt = string_field(row, "prompt")
        spec = code_tests_spec(prompt, string_field(row, "test"), string_field(row, "entry_point"))
        messages, used = code_messages(prompt), _CODE_FIELDS
    elif present(row, "test_cases"):
        messages, spec, used = _conversation(row), cases_spec(row["test_cases"], "test_cases."), _STDIO_FIELDS
    elif present(row, "inputs") or present(row, "outputs"):
        cases = {key: row.get(key) for key in ("inputs", "outputs", "fn_name")}
        messages, spec, used = _conversation(row), cases_spec(cases, ""), _STDIO_FIELDS | {"fn_name"}
    elif present(row, "gt_answer") or present(row, "answer"):
        field = "gt_answer" if present(row, "gt_answer") else "answer"
        messages, spec, used = _conversation(row), math_spec(row[field], field), _MATH_FIELDS
    else:
        # A column that is there but null (Parquet with mixed formats) is a row without tests, not a
        # row of an unknown format: name the fields.
        nulls = [f for f in ("test", "test_cases", "inputs", "outputs", "gt_answer", "answer") if f in row]
        if nulls:
            raise RowError(nulls[0], f"is null (null fields: {nulls}): a problem needs tests or an answer")
        raise RowError(None, f"no tests or answer (unknown format): the row has fields {sorted(row)}; {FORMATS_HELP}")
    return make_prompt(messages, spec, scalar_metadata(row, used), source_row, row.get("split"))
