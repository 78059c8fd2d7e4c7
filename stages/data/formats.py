"""The field's row formats, each turned into rlpipe's prompt (messages + reward spec + metadata); docs/data.md.

A source names its format (`{path, format}`) or leaves it `auto`: each row is then detected by its fields, in
this order: verl (`reward_model`), AReaL (`query_id`, when the source has an id2info.json), APPS / TACO /
LiveCodeBench (`input_output`, `public_test_cases`), MBPP (`test_list`), else rlpipe's own (rows.py). TRL rows
fit any prompt, so `trl` is used only when named.

Choices: a verl rule ground truth that is JSON cases (`{inputs, outputs[, fn_name]}` or LiveCodeBench's
`[{input, output, testtype}]`) or rlpipe's own `{kind: code_tests, ...}` spec (`rlpipe export --format verl`) is
code, a string or number a math answer, anything else (and `style: model`) kind `custom`, left to score.rewards.
What a peer's reward function receives (verl's data_source, ability, ground_truth and extra_info; TRL's columns)
travels in the metadata as the file gave it. AReaL's math answer is its first solution's last \\boxed{}.
LiveCodeBench's compressed private tests are skipped: decoding them unpickles, and nothing here unpickles data.
MBPP's entry point is the first non-builtin function its first assert calls.
"""

from __future__ import annotations

import ast
import builtins
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stages.data.rows import (
    CODE_SYSTEM_PROMPT,
    PromptRow,
    RowError,
    call_spec,
    cases_spec,
    check_test_code,
    custom_spec,
    make_prompt,
    math_spec,
    maybe_json,
    plain,
    present,
    prompt_of,
    rlpipe_prompt,
    scalar_metadata,
    stdio_spec,
    string_field,
)
from stages.sandbox.extract import extract_answer

CODE_REPLY = "Reply with the complete {what} in one ```python code block."


@dataclass(frozen=True)
class SourceContext:
    """What a row's conversion needs beyond the row: AReaL's id2info (None when the source has none)."""

    id2info: dict[str, Any] | None = None
    id2info_path: str = ""


def convert(row: Any, source_row: int, fmt: str, context: SourceContext) -> PromptRow:  # noqa: ANN401
    """One source row as a prompt, in the named format or (`auto`) the one its fields show."""
    if not isinstance(row, dict):
        raise RowError(None, f"must be a JSON object, got {type(row).__name__}")
    if fmt == "auto":
        fmt = detect(row, context)
    return CONVERTERS[fmt](row, source_row, context)


def detect(row: dict[str, Any], context: SourceContext) -> str:
    if present(row, "reward_model"):
        return "verl"
    if present(row, "query_id") and context.id2info is not None:
        return "areal"
    if present(row, "input_output") or present(row, "public_test_cases"):
        return "apps"
    if present(row, "test_list"):
        return "mbpp"
    return "rlpipe"


# ---------------------------------------------------------------------------------------------------------
# verl


def verl_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    messages = prompt_of(row.get("prompt"), "prompt")
    data_source = string_field(row, "data_source")
    reward_model = plain(maybe_json(row.get("reward_model")))
    if not isinstance(reward_model, dict):
        raise RowError("reward_model", "must be an object {style, ground_truth}")
    extra_info = plain(maybe_json(row.get("extra_info")))
    if extra_info is not None and not isinstance(extra_info, dict):
        raise RowError("extra_info", f"must be an object, got {type(extra_info).__name__}")
    truth = reward_model.get("ground_truth")
    style = reward_model.get("style") or "rule"
    ability = row.get("ability")
    metadata = {"data_source": data_source, "ability": ability, "ground_truth": truth, "extra_info": extra_info or {}}
    if style == "model":
        spec = custom_spec(metadata)
    elif truth is None:
        raise RowError("reward_model.ground_truth", "is null: a rule-style reward needs a ground truth")
    else:
        spec = _verl_rule_spec(truth, ability, metadata)
    return make_prompt(messages, spec, metadata, source_row)


def _verl_rule_spec(truth: Any, ability: Any, metadata: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401
    field = "reward_model.ground_truth"
    parsed = maybe_json(truth)
    if isinstance(parsed, dict) and parsed.get("kind") == "code_tests":
        return rlpipe_code_tests(parsed, field)
    if isinstance(parsed, dict) and ("inputs" in parsed or "outputs" in parsed):
        return apps_cases(parsed, field + ".")
    if isinstance(parsed, list) and parsed and all(isinstance(case, dict) and "input" in case for case in parsed):
        return lcb_cases(parsed, None, field)
    if ability == "code":
        raise RowError(field, "ability is 'code' but the ground truth is not test cases: expected JSON "
                       "{inputs, outputs[, fn_name]} or [{input, output, testtype}]")
    if isinstance(truth, str | int | float) and not isinstance(truth, bool):
        return math_spec(truth, field)
    return custom_spec(metadata)  # a list of answers, an object: the user's reward function reads it


def rlpipe_code_tests(spec: dict[str, Any], field: str) -> dict[str, Any]:
    """A ground truth that is rlpipe's own HumanEval-style spec (what `rlpipe export --format verl` writes, verl
    having no spelling for check(candidate) tests), checked and kept as it is, so the prompt id survives."""
    unknown = set(spec) - {"kind", "entry_point", "preamble", "test"}
    if unknown:
        raise RowError(field, f"a code_tests ground truth has unknown fields {sorted(unknown)}")
    entry_point, preamble = spec.get("entry_point"), spec.get("preamble", "")
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise RowError(f"{field}.entry_point", f"must be a Python identifier, got {entry_point!r}")
    if not isinstance(preamble, str):
        raise RowError(f"{field}.preamble", f"must be a string, got {type(preamble).__name__}")
    test = spec.get("test")
    if not isinstance(test, str):
        raise RowError(f"{field}.test", f"must be a string, got {type(test).__name__}")
    check_test_code(test, f"{field}.test")
    return spec


# ---------------------------------------------------------------------------------------------------------
# Colossal-RL, AReaL, TRL


def colossal_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    if not present(row, "messages"):
        raise RowError("messages", "is missing: Colossal-RL rows are messages + gt_answer or test_cases")
    if not (present(row, "gt_answer") or present(row, "test_cases")):
        raise RowError(None, f"needs gt_answer (math) or test_cases (code); the row has fields {sorted(row)}")
    return rlpipe_prompt(row, source_row)


def areal_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    if context.id2info is None:
        raise RowError(None, "format 'areal' needs an id2info.json (beside the file, or the source's id2info)")
    query_id = row.get("query_id")
    if isinstance(query_id, bool) or not isinstance(query_id, str | int):
        raise RowError("query_id", f"must be a string or an integer, got {type(query_id).__name__}")
    messages = prompt_of(row.get("prompt"), "prompt")
    info = context.id2info.get(str(query_id))
    if not isinstance(info, dict):
        raise RowError("query_id", f"{query_id!r} has no entry (an object) in {context.id2info_path}")
    try:
        spec = _areal_spec(info, f"id2info[{query_id}].")
    except RowError as error:
        raise RowError(error.field, f"{error.message} ({context.id2info_path})") from None
    metadata = scalar_metadata(row, {"prompt"}) | {"query_id": query_id}
    return make_prompt(messages, spec, metadata, source_row, row.get("split"))


def _areal_spec(info: dict[str, Any], where: str) -> dict[str, Any]:
    if present(info, "input_output") or info.get("task") == "code":
        return apps_cases(plain(maybe_json(info.get("input_output"))), where + "input_output.")
    if present(info, "solutions"):
        solutions = info["solutions"]
        if not isinstance(solutions, list) or not solutions or not isinstance(solutions[0], str):
            raise RowError(where + "solutions", "must be a non-empty list of strings")
        return math_spec(extract_answer(solutions[0]) or solutions[0], where + "solutions[0]")
    if present(info, "answer"):
        return math_spec(info["answer"], where + "answer")
    raise RowError(where.rstrip("."), f"has neither solutions (math) nor input_output (code): {sorted(info)}")


def trl_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    if not present(row, "prompt"):
        raise RowError("prompt", "is missing: TRL rows are a prompt (text or messages) plus any columns")
    messages = prompt_of(row["prompt"], "prompt")
    columns = {key: plain(value) for key, value in row.items() if key not in ("prompt", "split")}
    for key, value in columns.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise RowError(key, f"is not a JSON value ({type(value).__name__}): reward functions get it") from None
    return make_prompt(messages, custom_spec(columns), columns, source_row, row.get("split"))


# ---------------------------------------------------------------------------------------------------------
# APPS / TACO / LiveCodeBench, MBPP

_QUESTION_FIELDS = ("question", "question_content", "problem", "prompt")


def _text(value: Any) -> Any:  # noqa: ANN401
    """APPS/TACO store a stdin or stdout as a string or as a list of lines."""
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    return value


def apps_cases(cases: Any, prefix: str) -> dict[str, Any]:  # noqa: ANN401
    """`{inputs, outputs}` (stdin/stdout; each a string or a list of lines) or, with `fn_name`, call-based
    (each input a list of arguments)."""
    if not isinstance(cases, dict):
        raise RowError(prefix.rstrip("."), "must be a JSON object {inputs, outputs[, fn_name]}")
    if cases.get("fn_name") is not None:
        return cases_spec(cases, prefix)
    inputs, outputs = cases.get("inputs"), cases.get("outputs")
    inputs = [_text(item) for item in inputs] if isinstance(inputs, list) else inputs
    outputs = [_text(item) for item in outputs] if isinstance(outputs, list) else outputs
    return stdio_spec(inputs, outputs, prefix)


def lcb_cases(tests: list[Any], fn_name: str | None, field: str) -> dict[str, Any]:
    """LiveCodeBench's `[{input, output, testtype}]`: all `stdin`, or all `functional` (each input one JSON
    argument per line, the output one JSON value; the function's name from the row's metadata)."""
    types = {test.get("testtype", "stdin") if isinstance(test, dict) else None for test in tests}
    if None in types:
        raise RowError(field, "must be a list of {input, output, testtype} objects")
    if types == {"stdin"}:
        return stdio_spec([t.get("input") for t in tests], [t.get("output") for t in tests], field + ".")
    if types != {"functional"}:
        raise RowError(field, f"mixes test types {sorted(types)}: expected all stdin or all functional")
    fn_name = fn_name or next((t.get("metadata", {}).get("func_name") for t in tests if t.get("metadata")), None)
    inputs, outputs = [], []
    for i, test in enumerate(tests):
        try:
            inputs.append([json.loads(line) for line in str(test.get("input")).split("\n") if line.strip()])
            outputs.append(json.loads(str(test.get("output"))))
        except json.JSONDecodeError as error:
            raise RowError(f"{field}[{i}]", f"a functional test's input is one JSON value per line: {error}") from None
    return call_spec(fn_name, inputs, outputs, field + ".")


def _lcb_function_name(row: dict[str, Any]) -> str | None:
    metadata = maybe_json(row.get("metadata"))
    return metadata.get("func_name") if isinstance(metadata, dict) else None


def apps_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    question_field = next((f for f in _QUESTION_FIELDS if present(row, f)), "question")
    question = string_field(row, question_field)
    if present(row, "input_output"):
        spec = apps_cases(plain(maybe_json(row["input_output"])), "input_output.")
    elif present(row, "public_test_cases"):
        tests = plain(maybe_json(row["public_test_cases"]))
        if not isinstance(tests, list):
            raise RowError("public_test_cases", "must be a JSON list of {input, output, testtype}")
        private = plain(maybe_json(row.get("private_test_cases")))
        if isinstance(private, list):  # else compressed (pickled): skipped, see the module docstring
            tests = tests + private
        spec = lcb_cases(tests, _lcb_function_name(row), "public_test_cases")
    else:
        raise RowError("input_output", "is missing: APPS-style rows need input_output (or public_test_cases)")
    starter = row.get("starter_code") if isinstance(row.get("starter_code"), str) else ""
    messages = [{"role": "system", "content": CODE_SYSTEM_PROMPT}, {"role": "user", "content": _apps_request(
        question, starter, spec)}]
    used = {question_field, "input_output", "public_test_cases", "private_test_cases", "starter_code", "solutions",
            "metadata"}
    return make_prompt(messages, spec, scalar_metadata(row, used), source_row, row.get("split"))


def _apps_request(question: str, starter: str, spec: dict[str, Any]) -> str:
    parts = [question.strip()]
    if spec["kind"] == "code_call":
        parts.append(f"Write the function `{spec['fn_name']}`" + (" starting from:" if starter.strip() else "."))
        if starter.strip():
            parts.append(f"```python\n{starter.strip()}\n```")
        parts.append(CODE_REPLY.format(what="code"))
    else:
        parts.append("Write a Python program that reads the input from standard input and prints the answer. "
                     + CODE_REPLY.format(what="program"))
    return "\n\n".join(parts)


def _called_function(statement: str, field: str) -> str:
    try:
        tree = ast.parse(statement)
    except SyntaxError as error:
        raise RowError(field, f"is not valid Python: {error.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
            return node.func.id
    raise RowError(field, "calls no function by name: MBPP tests look like `assert f(...) == ...`")


def mbpp_prompt(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    text_field = "text" if present(row, "text") else "prompt"
    text = string_field(row, text_field)
    tests = row.get("test_list")
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise RowError("test_list", "must be a non-empty list of assert statements")
    entry_point = _called_function(tests[0], "test_list[0]")
    imports = row.get("test_imports") or []
    if not isinstance(imports, list) or not all(isinstance(line, str) for line in imports):
        raise RowError("test_imports", "must be a list of import statements")
    setup = row.get("test_setup_code") or ""
    if not isinstance(setup, str):
        raise RowError("test_setup_code", f"must be a string, got {type(setup).__name__}")
    preamble = "".join(line + "\n" for line in imports) + (setup.strip("\n") + "\n" if setup.strip() else "")
    test = "def check(candidate):\n" + "".join(
        "".join(f"    {line}\n" for line in statement.strip("\n").splitlines()) for statement in tests
    )
    check_test_code(test, "test_list")
    listing = "\n".join(statement.strip() for statement in tests)
    request = (f"{text.strip()}\nYour code should pass these tests:\n\n```python\n{listing}\n```\n\n"
               + CODE_REPLY.format(what="function"))
    messages = [{"role": "system", "content": CODE_SYSTEM_PROMPT}, {"role": "user", "content": request}]
    spec = {"kind": "code_tests", "entry_point": entry_point, "preamble": preamble, "test": test}
    used = {text_field, "test_list", "test_imports", "test_setup_code", "code", "challenge_test_list"}
    return make_prompt(messages, spec, scalar_metadata(row, used), source_row, row.get("split"))


def rlpipe_row(row: dict[str, Any], source_row: int, context: SourceContext) -> PromptRow:
    return rlpipe_prompt(row, source_row)


CONVERTERS: dict[str, Callable[[dict[str, Any], int, SourceContext], PromptRow]] = {
    "rlpipe": rlpipe_row,
    "verl": verl_prompt,
    "colossal": colossal_prompt,
    "areal": areal_prompt,
    "trl": trl_prompt,
    "apps": apps_prompt,
    "mbpp": mbpp_prompt,
}
