"""Cutting HumanEval's check(candidate) into individually scored tests."""

from __future__ import annotations

import pytest

from stages.sandbox.checks import CheckSpecError, plan_checks

TEST = """
METADATA = {'author': 'x'}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9], 0.3) == True
    assert candidate([1.0, 2.0], 0.05) == False
    import math
    for x in range(3):
        assert candidate([x], 1.0) == False
    assert True, "always"
"""


def test_each_top_level_assert_is_a_test_and_setup_is_not():
    plan = plan_checks("from typing import List\n", TEST)
    assert plan.split
    assert plan.parameter == "candidate"
    assert plan.test_names == [
        "assert candidate([1.0, 2.0, 3.9], 0.3) == True",
        "assert candidate([1.0, 2.0], 0.05) == False",
        "for x in range(3):",
        'assert True, "always"',
    ]
    # `import math` is a step without a name: it runs, it is not scored
    assert len(plan.steps) == 5
    assert plan.steps[2].name is None


def test_check_with_return_is_one_test():
    plan = plan_checks(
        "", "def check(candidate):\n    if candidate(1) == 1:\n        return\n    assert False\n"
    )
    assert not plan.split
    assert plan.test_names == ["check(candidate)"]


def test_check_without_top_level_assert_is_one_test():
    plan = plan_checks("", "def check(c):\n    helper(c)\n\ndef helper(c):\n    assert c(1) == 2\n")
    assert not plan.split
    assert plan.parameter == "c"


def test_unusable_test_code_raises():
    with pytest.raises(CheckSpecError, match="no check"):
        plan_checks("", "def test():\n    pass\n")
    with pytest.raises(CheckSpecError, match="does not parse"):
        plan_checks("", "def check(candidate:\n")


def test_plans_are_cached_per_test_text():
    assert plan_checks("", TEST) is plan_checks("", TEST)
