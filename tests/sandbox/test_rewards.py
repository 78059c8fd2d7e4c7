"""score.rewards (stages/sandbox/rewards.py): weighted built-ins, user functions with verl's and TRL's signatures,
their faults (raise, hang, NaN) marking only their row, `run_code` through the stage's sandbox, and the checks
`rlpipe run` makes before anything runs. Every expected reward is worked out by hand in the test."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from schemas.config import ScoreConfig
from schemas.contracts import table_reward_bounds
from stages.data.sources import load_prompts
from stages.sandbox import Sandbox, ScoreJob, rewards
from stages.sandbox.rewards import RewardInput, RewardSetupError, check_rewards, think_format

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ADD_SPEC = {
    "kind": "code_tests", "entry_point": "add", "preamble": "",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
            "    assert candidate(-1, 1) == 0\n    assert candidate(0, 5) == 5\n",
}
MATH_SPEC = {"kind": "math", "answer": "42"}
ROW = RewardInput([{"role": "user", "content": "What is 6 * 7?"}], {"solution": "42", "level": 3}, "quiz")

REWARD_FILE = '''
import math, time
from stages.sandbox import run_code

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "RAISE" in solution_str:
        raise ValueError("asked to raise")
    if "HANG" in solution_str:
        time.sleep(60)
    if "NAN" in solution_str:
        return float("nan")
    if "DOUBLE" in solution_str:  # runs the response's program through rlpipe's sandbox, never here
        program = solution_str.split("```python\\n")[1].split("```")[0]
        run = run_code(program, stdin="21\\n")
        return {"score": 1.0 if run.ok and run.stdout.strip() == "42" else 0.0, "status": run.status}
    return {"score": 0.25 if str(ground_truth) in solution_str else 0.0, "source": data_source}

def has_solution(prompts, completions, solution, **kwargs):
    # TRL: None = does not apply to this completion
    return [1.0 if s in c[0]["content"] else None for c, s in zip(completions, solution)]

def wrong_signature(text):
    return 1.0
'''


def code(body: str) -> str:
    return f"```python\n{body}\n```"


@pytest.fixture()
def reward_file(tmp_path: Path) -> str:
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_FILE)
    return str(path)


def with_rewards(sandbox_config: ScoreConfig, *entries: dict) -> ScoreConfig:
    return ScoreConfig(**(sandbox_config.model_dump() | {"rewards": list(entries)}))


def test_think_format_reward() -> None:
    assert think_format("<think>a\nb</think>\n<answer>42</answer>") == 1.0
    assert think_format("  <think></think><answer>x</answer>\n") == 1.0
    assert think_format("<think>a</think> 42") == 0.0
    assert think_format("<answer>42</answer><think>a</think>") == 0.0
    assert think_format("<think>a</think><answer>42</answer> and more") == 0.0


def test_default_is_the_verifier_alone(sandbox: Sandbox, sandbox_config: ScoreConfig) -> None:
    jobs = [ScoreJob(code("def add(a, b):\n    return a * b"), ADD_SPEC), ScoreJob("no code", ADD_SPEC)]
    rows = [ROW, ROW]
    default = rewards.score(sandbox, sandbox_config, jobs, rows)
    explicit = rewards.score(sandbox, with_rewards(sandbox_config, {"fn": "code_tests"}), jobs, rows)
    assert [(r.reward, r.status, r.passed, r.total) for r in default] == [(0.25, "fail", 1, 4), (0.0, "no_code", 0, 4)]
    assert [(r.reward, r.status, r.tests) for r in explicit] == [(r.reward, r.status, r.tests) for r in default]


def test_weighted_sum_of_verifier_format_and_user_function(
    sandbox: Sandbox, sandbox_config: ScoreConfig, reward_file: str
) -> None:
    cfg = with_rewards(sandbox_config, {"fn": "code_tests", "weight": 2.0}, {"fn": "think_format", "weight": 0.5},
                       {"fn": f"{reward_file}:compute_score", "weight": -1.0})
    formatted = "<think>multiply?</think>\n<answer>\n" + code("def add(a, b):\n    return a * b") + "\n</answer>"
    plain = code("def add(a, b):\n    return a + b") + "\n# 3"
    results = rewards.score(sandbox, cfg, [ScoreJob(formatted, ADD_SPEC), ScoreJob(plain, ADD_SPEC)], [ROW, ROW])
    # a * b passes 1 of 4 tests; formatted; ground truth (the test code) is not in the response: 0
    assert results[0].reward == pytest.approx(2 * 0.25 + 0.5 * 1 + -1 * 0.0)
    # a + b passes 4 of 4; no think/answer; compute_score: 0 again
    assert results[1].reward == pytest.approx(2 * 1.0 + 0.5 * 0 + -1 * 0.0)
    assert (results[0].status, results[0].passed, results[0].total) == ("fail", 1, 4)
    assert results[0].tests[-2:] == [
        {"name": "reward think_format", "passed": True, "status": "ok", "message": "1 x weight 0.5"},
        {"name": f"reward {reward_file}:compute_score", "passed": False, "status": "ok", "message": "0 x weight -1"},
    ]
    assert table_reward_bounds(with_rewards(sandbox_config, {"fn": "code_tests", "weight": 2.0},
                                            {"fn": "think_format", "weight": 0.5})) == (0.0, 2.5)


def test_verl_and_trl_functions_and_their_faults(sandbox: Sandbox, sandbox_config: ScoreConfig, reward_file: str):
    cfg = with_rewards(sandbox_config, {"fn": "math"}, {"fn": f"{reward_file}:compute_score", "weight": 2.0},
                       {"fn": f"{reward_file}:has_solution", "weight": 0.5})
    texts = [r"\boxed{42}", r"RAISE \boxed{42}", r"HANG \boxed{7}", r"NAN \boxed{42}", r"\boxed{41}", "no answer"]
    started = __import__("time").monotonic()
    results = rewards.score(sandbox, cfg, [ScoreJob(text, MATH_SPEC) for text in texts], [ROW] * len(texts))
    seconds = __import__("time").monotonic() - started
    ok, raised, hung, nan, wrong, nothing = results
    # verifier 1 + compute_score 2 x 0.25 (the ground truth "42" is in the text) + has_solution 0.5 x 1
    assert (ok.status, ok.reward) == ("ok", pytest.approx(1 + 0.5 + 0.5))
    assert (raised.status, raised.reward) == ("error", pytest.approx(1 + 0.5))  # the failing term counts 0
    assert raised.tests[1]["status"] == "error"
    # every message ends with the user's file:line (compute_score is defined on line 5 and raises on line 7)
    assert raised.tests[1]["message"] == f"ValueError: asked to raise ({reward_file}:7)"
    assert hung.status == "error"
    assert hung.tests[1]["message"] == f"no result within score.timeout_s = 2 s ({reward_file}:5)"
    assert [t["name"] for t in hung.tests] == ["answer", f"reward {reward_file}:compute_score"]  # TRL: None
    assert (nan.status, nan.tests[1]["message"]) == ("error", f"returned a non-finite value nan ({reward_file}:5)")
    # after the hang the process was replaced: the next rows are scored as usual
    assert (wrong.status, wrong.reward) == ("fail", 0.0)
    assert (nothing.status, nothing.reward, len(nothing.tests)) == ("no_code", 0.0, 1)  # nothing to grade
    assert seconds < 30  # the 60 s sleep was cut at timeout_s


def test_reward_function_runs_model_code_through_the_stages_sandbox(
    sandbox: Sandbox, sandbox_config: ScoreConfig, reward_file: str
) -> None:
    cfg = with_rewards(sandbox_config, {"fn": f"{reward_file}:compute_score"})
    custom = {"kind": "custom", "columns": {}}
    asked: list[dict] = []

    class Counting:
        """The stage's sandbox, counting the run_code requests that reach it."""

        def score(self, jobs: list, progress: object = None) -> list:
            return sandbox.score(jobs, progress=progress)

        def run_code(self, request: dict) -> dict:
            asked.append(request)
            return sandbox.run_code(request)

    right = "DOUBLE " + code("print(int(input()) * 2)")
    wrong = "DOUBLE " + code("print(int(input()) + 2)")
    loops = "DOUBLE " + code("while True:\n    pass")
    results = rewards.score(Counting(), cfg, [ScoreJob(t, custom) for t in (right, wrong, loops)], [ROW] * 3)
    assert [(r.reward, r.status) for r in results] == [(1.0, "ok"), (0.0, "fail"), (0.0, "fail")]
    assert [request["stdin"] for request in asked] == ["21\n"] * 3  # all three ran in the stage's sandbox
    # the looping program used its own run_timeout (score.timeout_s), not the function's budget
    assert results[2].tests[0]["status"] == "ok"


def test_a_user_module_on_the_working_directory_and_trl_columns(
    sandbox: Sandbox, sandbox_config: ScoreConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "graders").mkdir()
    (tmp_path / "graders" / "__init__.py").write_text("")
    (tmp_path / "graders" / "levels.py").write_text(textwrap.dedent("""
        def by_level(prompts, completions, level, tags=None, **kwargs):
            assert prompts[0][-1]["role"] == "user"
            return [float(l) / 10 * len(c[0]["content"]) for c, l in zip(completions, level)]
    """))
    monkeypatch.chdir(tmp_path)
    cfg = with_rewards(sandbox_config, {"fn": "graders.levels:by_level"})
    check_rewards(cfg, {"custom"})
    (result,) = rewards.score(sandbox, cfg, [ScoreJob("abcd", {"kind": "custom", "columns": {}})], [ROW])
    assert result.reward == pytest.approx(3 / 10 * 4) and result.status == "ok"


def test_check_rewards_names_the_entry(tmp_path: Path, reward_file: str, sandbox_config: ScoreConfig) -> None:
    (tmp_path / "broken.py").write_text("import no_such_package_xyz\n")
    cases = [
        ({"fn": f"{tmp_path}/broken.py:f"}, "score.rewards[1] '" + f"{tmp_path}/broken.py:f': ModuleNotFoundError"),
        ({"fn": f"{tmp_path}/missing.py:f"}, "missing.py does not exist"),
        ({"fn": f"{reward_file}:nope"}, "has no function 'nope'"),
        ({"fn": f"{reward_file}:wrong_signature"}, "parameters (text) match neither verl's"),
        ({"fn": "no_such_package_xyz.mod:f"}, "score.rewards[1] 'no_such_package_xyz.mod:f': ModuleNotFoundError"),
    ]
    for entry, message in cases:
        with pytest.raises(RewardSetupError) as error:
            check_rewards(with_rewards(sandbox_config, {"fn": "math"}, entry), {"math"})
        assert message in str(error.value)
    with pytest.raises(RewardSetupError, match="prompts of kind custom have no reward"):
        check_rewards(sandbox_config, {"code_tests", "custom"})
    with pytest.raises(RewardSetupError, match="prompts of kind code_stdio have no reward: add code_stdio"):
        check_rewards(with_rewards(sandbox_config, {"fn": "math"}, {"fn": "think_format"}), {"math", "code_stdio"})
    check_rewards(sandbox_config, {"code_tests", "code_stdio", "code_call", "math"})  # the default scores these
    check_rewards(with_rewards(sandbox_config, {"fn": f"{reward_file}:compute_score"}), {"custom", "math"})


def test_user_function_bounds_are_only_finite(sandbox_config: ScoreConfig, reward_file: str) -> None:
    low, high = table_reward_bounds(with_rewards(sandbox_config, {"fn": f"{reward_file}:compute_score"}))
    assert low == -1e300 and high == 1e300
    assert table_reward_bounds(sandbox_config) == (0.0, 1.0)


@pytest.mark.parametrize(
    ("fixture", "row", "right", "wrong"),
    [
        # MBPP's own reference solution passes its tests
        ("mbpp.jsonl", 0, json.loads((FIXTURES / "mbpp.jsonl").read_text().splitlines()[0])["code"],
         "def similar_elements(a, b):\n    return tuple(a)"),
        ("mbpp.jsonl", 1, json.loads((FIXTURES / "mbpp.jsonl").read_text().splitlines()[1])["code"],
         "def is_not_prime(n):\n    return n % 2 == 0"),
        ("apps.jsonl", 0, "print(2 * int(input()))", "print(int(input()) + 2)"),
        ("apps.jsonl", 1, "def biggest(xs):\n    return max(xs)", "def biggest(xs):\n    return xs[0]"),
        ("apps.jsonl", 2, "print(input() + ' ' + input())", "print(input())"),
        ("apps.jsonl", 3, "class Solution:\n    def countAbove(self, nums, k):\n        return sum(x > k for x in nums)"
         , "class Solution:\n    def countAbove(self, nums, k):\n        return len(nums)"),
        ("verl_rl.jsonl", 1, "a, b = map(int, input().split())\nprint(a + b)", "print(0)"),
        ("verl_rl.jsonl", 2, "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"),
    ],
)
def test_every_code_format_scores_a_right_and_a_wrong_solution(
    sandbox: Sandbox, fixture: str, row: int, right: str, wrong: str
) -> None:
    from schemas.config import DataConfig

    source = str(FIXTURES / fixture)
    table = load_prompts(source, "train", DataConfig(train=[source]))
    spec = json.loads(table.column("reward_spec")[row].as_py())
    good, bad = sandbox.score([ScoreJob(code(right), spec), ScoreJob(code(wrong), spec)])
    assert (good.status, good.reward) == ("ok", 1.0), good.tests
    assert bad.status == "fail" and bad.reward < 1.0 and math.isfinite(bad.reward)


def test_wrong_results_name_the_users_line_not_rlpipes(
    sandbox: Sandbox, sandbox_config: ScoreConfig, tmp_path: Path
) -> None:
    """A string, a NaN, an exception raised inside the standard library: each message ends with the user's
    file and line (the function's first line for a bad value, the user's line that called json for the raise)."""
    path = tmp_path / "faulty.py"
    path.write_text(textwrap.dedent('''\
        import json


        def grade(data_source, solution_str, ground_truth, extra_info):
            if "STRING" in solution_str:
                return "1.0"
            return json.loads(solution_str)
    '''))
    cfg = with_rewards(sandbox_config, {"fn": f"{path}:grade"})
    custom = {"kind": "custom", "columns": {}}
    texts = ["STRING", "NaN", "not json", "0.5"]
    results = rewards.score(sandbox, cfg, [ScoreJob(t, custom) for t in texts], [ROW] * len(texts))
    messages = [r.tests[0]["message"] for r in results]
    assert messages[0] == f"returned str '1.0', not a number ({path}:4)"
    assert messages[1] == f"returned a non-finite value nan ({path}:4)"
    assert messages[2].startswith("JSONDecodeError: Expecting value") and messages[2].endswith(f"({path}:7)")
    assert "reward_host.py" not in " ".join(messages)
    assert [(r.status, r.reward) for r in results] == [("error", 0.0)] * 3 + [("ok", 0.5)]
    # the terms each result carries, by short name: what the stage's per-function metrics are made of
    assert results[0].terms == [{"name": "grade", "value": None, "error": messages[0]}]
    assert results[3].terms == [{"name": "grade", "value": 0.5, "error": ""}]


def test_short_names_are_the_functions_and_disambiguate_duplicates() -> None:
    entries = [{"fn": "code_tests"}, {"fn": "rewards/concise.py:compute_score"}, {"fn": "a/b/style.py:compute_score"},
               {"fn": "graders.levels:by_level"}, {"fn": "x/math.py:math"}, {"fn": "math"},
               {"fn": "one/same.py:f"}, {"fn": "two/same.py:f"}]
    cfg = ScoreConfig(rewards=entries)
    assert rewards.reward_names(cfg.rewards) == [
        "code_tests", "concise.compute_score", "style.compute_score", "by_level", "math.math", "math", "same.f_6",
        "same.f_7"]


def summary_of(cfg: ScoreConfig, terms_by_row: list[list[dict]]) -> list[rewards.RewardSummary]:
    from stages.sandbox import ScoreResult

    return rewards.summarize(cfg, [ScoreResult(0.0, 0, 0, "ok", terms=terms) for terms in terms_by_row])


def test_summary_and_the_failure_bound_by_hand() -> None:
    cfg = ScoreConfig(rewards=[{"fn": "math", "weight": 2.0}, {"fn": "m.py:f"}, {"fn": "m.py:g"}])

    def term(name: str, value: float | None, error: str = "") -> dict:
        return {"name": name, "value": value, "error": error}

    rows = [
        [term("math", 1.0), term("f", 0.5), term("g", None, "RuntimeError: no\nmore (m.py:3)")],
        [term("math", 0.0), term("f", None), term("g", None, "RuntimeError: second (m.py:3)")],
        [term("math", 0.5), term("f", None, "TypeError: x (m.py:1)"), term("g", None, "RuntimeError: third")],
    ]
    math_, f, g = summary_of(cfg, rows)
    assert (math_.name, math_.calls, math_.errors, math_.mean, math_.weight) == ("math", 3, 0, 0.5, 2.0)
    # f: 3 calls, one failed, one None (TRL: does not apply), one value 0.5
    assert (f.calls, f.errors, f.mean, f.error_frac) == (3, 1, 0.5, 1 / 3)
    assert (g.calls, g.errors, g.mean, g.error_frac) == (3, 3, None, 1.0)
    assert g.first_error == "RuntimeError: no more (m.py:3)"  # the first, on one line
    assert f.line() == "reward f: mean 0.500 over 3 calls, 1 failed (33%), first: TypeError: x (m.py:1)"
    assert math_.line() == "reward math: mean 0.500 over 3 calls, none failed"
    assert g.metrics() == {"fn": "m.py:g", "weight": 1.0, "calls": 3, "errors": 3, "error_frac": 1.0, "values": 0,
                           "mean": None, "first_error": "RuntimeError: no more (m.py:3)"}
    # the default 1.0 stops g (every call failed), not f; 0.3 stops f too, f first in config order; null never
    from schemas.errors import InputError

    with pytest.raises(InputError) as stopped:
        rewards.check_failures(cfg, [math_, f, g])
    assert str(stopped.value) == ("reward function g (m.py:g) failed on 3 of 3 calls "
                                  "(score.max_reward_error_fraction = 1); first: RuntimeError: no more (m.py:3)")
    rewards.check_failures(cfg, [math_, f])
    strict = ScoreConfig(**(cfg.model_dump() | {"max_reward_error_fraction": 0.3}))
    with pytest.raises(InputError, match=r"^reward function f \(m.py:f\) failed on 1 of 3 calls"):
        rewards.check_failures(strict, [math_, f, g])
    rewards.check_failures(ScoreConfig(**(cfg.model_dump() | {"max_reward_error_fraction": None})), [math_, f, g])
    rewards.check_failures(ScoreConfig(**(cfg.model_dump() | {"max_reward_error_fraction": 0.0})), [math_])
    # the default score.rewards (empty): one term per verifier kind present
    default = summary_of(ScoreConfig(), [[term("math", 1.0)], [term("code_tests", 0.25)], [term("math", 0.0)]])
    assert [(s.name, s.calls, s.mean) for s in default] == [("code_tests", 1, 0.25), ("math", 2, 0.5)]
