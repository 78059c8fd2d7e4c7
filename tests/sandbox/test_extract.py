"""Which part of a response gets graded: the last Python block, the last boxed/tagged answer."""

from __future__ import annotations

from stages.sandbox import extract_answer, extract_code
from stages.sandbox.extract import last_number


def test_last_python_block_wins():
    text = "First:\n```python\nx = 1\n```\nthen\n```python\ndef f():\n    return 2\n```\nDone."
    assert extract_code(text) == "def f():\n    return 2\n"


def test_python_block_preferred_over_later_untagged_block():
    text = "```python\nprint(1)\n```\nOutput:\n```\n1\n```"
    assert extract_code(text) == "print(1)\n"


def test_untagged_block_used_when_no_python_block():
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"


def test_other_languages_and_empty_blocks_are_not_code():
    assert extract_code("```bash\nls -la\n```") is None
    assert extract_code("```python\n\n```") is None
    assert extract_code("no fences at all") is None


def test_tag_variants_and_truncated_block():
    assert extract_code("```py\na = 1\n```") == "a = 1\n"
    assert extract_code("```Python3\nb = 2\n```") == "b = 2\n"
    # a response cut off by the token limit: the open block runs to the end
    assert extract_code("Here:\n```python\ndef g():\n    return 1") == "def g():\n    return 1\n"


def test_a_block_cut_off_after_a_complete_one_is_not_graded():
    # a solution, then an example the token limit cut mid-line (seen in humaneval-cpu runs, graded `error`)
    text = ("```python\ndef f(x):\n    return x + 1\n```\n\nExample usage:\n```python\nprint(f(1))  # Output: 2\n"
            "print(f(")
    assert extract_code(text) == "def f(x):\n    return x + 1\n"
    # the same for untagged blocks, and a complete python block still wins over a later untagged one
    assert extract_code("```\nprint(1)\n```\nthen\n```\nprint(") == "print(1)\n"
    assert extract_code("```python\nprint(1)\n```\n```\nprint(2)") == "print(1)\n"
    # a cut python block with no complete python block before it is still the python code
    assert extract_code("```\nprint(1)\n```\n```python\nprint(2)") == "print(2)\n"
    # a fence closed at the very end of the text closes its block
    assert extract_code("```python\nx = 1\n```\n```python\ny = 2\n```") == "y = 2\n"


def test_boxed_answer_with_nested_braces_last_wins():
    assert extract_answer(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"


def test_answer_tag_and_precedence():
    assert extract_answer("so <answer> 42 </answer>") == "42"
    assert extract_answer(r"<answer>\boxed{7}</answer>") == "7"
    assert extract_answer(r"\boxed{3} and <answer>4</answer>") == "3"  # \boxed is looked for first
    assert extract_answer("no answer here") is None
    assert extract_answer(r"\boxed{unclosed") is None


def test_last_number_as_written_in_prose():
    assert last_number("48271 * 9173 = 442,789,883.") == "442789883"
    assert last_number("it fell to -3.5 then rose") == "-3.5"
    assert last_number("step 2: x = 10, so 12") == "12"
    assert last_number("no digits") is None
