"""Split a HumanEval-style `check(candidate)` into individually scored tests, for the trusted judge.

HumanEval's `test` field defines `check(candidate)`, whose body is mostly a sequence of asserts, with
some setup (imports, helper functions, loops over random inputs). We keep the dataset's code as it is
and only cut it at statement boundaries: each top-level statement of `check` that contains an `assert`
is one test; every other statement is setup that runs, in order, between them. The judge executes these
statements itself (see judge.py), with `candidate` bound to a proxy that calls the real function in the
sandbox and returns plain values, so no assert is ever evaluated where the candidate's code runs.

When the body cannot be cut (a `return` or `yield` in `check`, no assert at the top level), the whole
`check(candidate)` call is one test, as the brief asks.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
from dataclasses import dataclass
from types import CodeType


class CheckSpecError(ValueError):
    """The reward spec's test code is unusable (no check function, a syntax error)."""


@dataclass(frozen=True)
class Step:
    """One statement (or the whole check call) executed by the judge; `name` is set for tests."""

    code: CodeType
    name: str | None
    source: str  # the statement as text, for harnesses that run elsewhere (fusion.py)

    @property
    def is_test(self) -> bool:
        return self.name is not None


@dataclass(frozen=True)
class CheckPlan:
    module: CodeType  # preamble + test module: helper functions, METADATA, the check definition
    parameter: str  # the name check() gives the candidate, usually "candidate"
    steps: tuple[Step, ...]
    split: bool  # False when the whole check(candidate) call is one test

    @property
    def test_names(self) -> list[str]:
        return [step.name for step in self.steps if step.name is not None]


def _label(lines: list[str], node: ast.stmt) -> str:
    """The statement's first source line, whitespace-collapsed (ast.get_source_segment re-splits the
    whole source on every call, which made labelling quadratic in the test's length)."""
    line = lines[node.lineno - 1][node.col_offset :] if node.lineno <= len(lines) else ""
    text = " ".join(line.split()) or type(node).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _own_nodes(statement: ast.stmt) -> list[ast.AST]:
    """The nodes of a statement outside any nested function or class body (those are not check's)."""
    found: list[ast.AST] = []
    pending: list[ast.AST] = [statement]
    while pending:
        node = pending.pop()
        found.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                pending.append(child)
    return found


def _splittable(body: list[ast.stmt]) -> bool:
    # Statements of check() run at module level in the judge's namespace; these would change meaning
    # (or not compile) there.
    forbidden = (ast.Return, ast.Yield, ast.YieldFrom, ast.Nonlocal, ast.Await)
    return not any(isinstance(node, forbidden) for stmt in body for node in _own_nodes(stmt))


def _is_test(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return False
    return any(isinstance(node, ast.Assert) for node in _own_nodes(stmt))


def _compile(nodes: list[ast.stmt], filename: str) -> CodeType:
    return compile(ast.Module(body=nodes, type_ignores=[]), filename, "exec")


@functools.lru_cache(maxsize=256)
def plan_checks(preamble: str, test: str) -> CheckPlan:
    """Cut `test` into the judge's steps; raises CheckSpecError when there is no usable check().

    Cached: a group of samples of one prompt shares its plan (the plan is immutable; each job executes
    its code objects in a fresh namespace)."""
    try:
        module = ast.parse(preamble + "\n" + test if preamble else test)
    except SyntaxError as error:
        raise CheckSpecError(f"test code does not parse: {error}") from None
    checks = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if not checks:
        raise CheckSpecError("test code defines no check(candidate) function")
    check = checks[-1]
    if not check.args.args:
        raise CheckSpecError("check() takes no candidate argument")
    parameter = check.args.args[0].arg
    module_code = _compile(module.body, "<test>")
    lines = (preamble + "\n" + test if preamble else test).splitlines()
    body = check.body
    if _splittable(body) and any(_is_test(stmt) for stmt in body):
        steps = tuple(
            Step(
                _compile([stmt], "<test>"), _label(lines, stmt) if _is_test(stmt) else None, ast.unparse(stmt)
            )
            for stmt in body
        )
        return CheckPlan(module_code, parameter, steps, split=True)
    whole = f"check({parameter})"
    step = Step(compile(whole, "<test>", "exec"), "check(candidate)", whole)
    return CheckPlan(module_code, parameter, (step,), split=False)


# -- call-based cases (code_call) -------------------------------------------------------------------------

# Test code for call-based cases. It runs on the trusted side like any check (judge.py): the candidate's
# return value arrives as plain values, tuples become lists (JSON has no tuples), and an expected `[v]` also
# accepts `v` (APPS and TACO wrap many expected returns in a list).
_CALL_HELPERS = '''
def _as_json(value):
    if isinstance(value, (list, tuple)):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


def _same(got, want, case):
    got = _as_json(got)
    if got == want or (isinstance(want, list) and len(want) == 1 and got == want[0]):
        return True
    raise AssertionError(("case %d: expected %r, got %r" % (case, want, got))[:300])
'''

# Appended to the candidate's program (it runs in the sandbox): LeetCode-style answers define the function
# as a method of `class Solution`.
_SOLUTION_METHOD = (
    "\n\nif {fn!r} not in globals() and 'Solution' in globals():\n    {fn} = getattr(Solution(), {fn!r})\n"
)


def call_program(code: str, fn_name: str) -> str:
    """The candidate's code plus the lookup of `fn_name` on a `Solution` class when it has no such function."""
    return code + _SOLUTION_METHOD.format(fn=fn_name)


def call_test_source(fn_name: str, inputs: object, outputs: object) -> str:
    """`check(candidate)` with one assert per case: `candidate(*inputs[i])` must give `outputs[i]`."""
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise CheckSpecError(f"fn_name must be a Python identifier, got {fn_name!r}")
    if not isinstance(inputs, list) or not inputs or not all(isinstance(args, list) for args in inputs):
        raise CheckSpecError("inputs must be a non-empty list of argument lists")
    if not isinstance(outputs, list) or len(outputs) != len(inputs):
        raise CheckSpecError("outputs must be a list as long as inputs")
    cases = json.dumps([inputs, outputs])
    lines = ["import json as _json", _CALL_HELPERS, f"_INPUTS, _OUTPUTS = _json.loads({cases!r})", "",
             "def check(candidate):"]
    lines += [f"    assert _same(candidate(*_INPUTS[{i}]), _OUTPUTS[{i}], {i})" for i in range(len(inputs))]
    return "\n".join(lines) + "\n"


def plan_calls(fn_name: str, inputs: object, outputs: object) -> tuple[str, CheckPlan]:
    """(test source, plan) of call-based cases; the tests are named `case 0`, `case 1`, ..."""
    test = call_test_source(fn_name, inputs, outputs)
    return test, _named_case_plan(test)


@functools.lru_cache(maxsize=256)
def _named_case_plan(test: str) -> CheckPlan:
    plan = plan_checks("", test)
    names = iter(range(len(plan.test_names)))
    steps = tuple(dataclasses.replace(s, name=f"case {next(names)}") if s.is_test else s for s in plan.steps)
    return dataclasses.replace(plan, steps=steps)
