"""The built-in source `pytasks`: small function-writing problems with tests, generated from code.

HumanEval is hard for a 135M model (the base model solves about 4% of its held-out problems per sample), so
most GRPO groups on it are all-wrong and carry no signal. These problems have HumanEval's shape (signature,
docstring with examples, `check(candidate)` with asserts) at a first-course level (sum the even numbers,
reverse the words), so the base model solves some and groups have reward variance.

Each family draws its constants and function name from a generator seeded by (family, instance) and computes
every expected value by running its reference solution, so a test never disagrees with the docstring and the
same code always yields the same problems. Splits are by family (stages/data/sources.py hashes the family
name), so a held-out problem comes from a family never trained on: a held-out gain is a gain in writing small
functions, not in recalling one family's trick.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SOURCE = "pytasks"
INSTANCES_PER_FAMILY = 8
TESTS_PER_PROBLEM = 6
EXAMPLES_PER_PROBLEM = 2

_WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "robot", "green", "ocean", "maple",
          "candle", "pixel", "delta", "ember", "frost", "harbor", "island", "jungle", "kettle"]


@dataclass(frozen=True)
class Family:
    """One kind of problem. `make(rng)` returns (function name, constants) for one instance; the rest are
    functions of the constants: the signature's parameters, the docstring's first sentence, the reference
    solution, and the test inputs (argument tuples)."""

    name: str
    make: Callable[[random.Random], tuple[str, dict[str, Any]]]
    params: str  # "nums: list[int]"
    returns: str  # "int"
    describe: Callable[[dict[str, Any]], str]
    solve: Callable[..., Any]  # solve(constants, *args)
    inputs: Callable[[random.Random, dict[str, Any]], tuple]


def _ints(rng: random.Random, low: int = -20, high: int = 20, size: tuple[int, int] = (0, 7)) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(*size))]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 5)))


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + "  ") for _ in range(rng.randint(0, 12))).strip()


def _pick(*names: str) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(names)


def _const(names: Callable[[random.Random], str], **ranges: tuple[int, int]) -> Callable[..., tuple[str, dict]]:
    """An instance maker: a name from `names` and each constant drawn uniformly from its (low, high)."""
    return lambda rng: (names(rng), {key: rng.randint(low, high) for key, (low, high) in ranges.items()})


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _one(make: Callable[[random.Random], Any]) -> Callable[[random.Random, dict], tuple]:
    return lambda rng, c: (make(rng),)


FAMILIES: list[Family] = [
    Family("add_constant", _const(_pick("add_k", "plus_k", "increase_by_k"), k=(2, 50)), "x: int", "int",
           lambda c: f"Return x plus {c['k']}.", lambda c, x: x + c["k"], _one(lambda r: r.randint(-100, 100))),
    Family("multiply_constant", _const(_pick("times_k", "multiply_by_k", "scale"), k=(2, 12)), "x: int", "int",
           lambda c: f"Return x multiplied by {c['k']}.", lambda c, x: x * c["k"],
           _one(lambda r: r.randint(-50, 50))),
    Family("is_multiple", _const(_pick("is_multiple", "divisible_by_k", "is_divisible"), k=(2, 9)), "n: int",
           "bool", lambda c: f"Return True if n is divisible by {c['k']}, otherwise False.",
           lambda c, n: n % c["k"] == 0, _one(lambda r: r.randint(-60, 60))),
    Family("power", _const(_pick("power_k", "raise_to_k", "pow_k"), k=(2, 4)), "x: int", "int",
           lambda c: f"Return x raised to the power {c['k']}.", lambda c, x: x ** c["k"],
           _one(lambda r: r.randint(-9, 9))),
    Family("abs_difference", _const(_pick("abs_difference", "distance", "gap")), "a: int, b: int", "int",
           lambda c: "Return the absolute difference between a and b.", lambda c, a, b: abs(a - b),
           lambda r, c: (r.randint(-50, 50), r.randint(-50, 50))),
    Family("clamp", _const(_pick("clamp", "limit", "bound"), low=(-10, 0), width=(5, 20)), "x: int", "int",
           lambda c: f"Return x limited to the range [{c['low']}, {c['low'] + c['width']}]: values below "
                     f"{c['low']} become {c['low']}, values above {c['low'] + c['width']} become "
                     f"{c['low'] + c['width']}.",
           lambda c, x: max(c["low"], min(c["low"] + c["width"], x)), _one(lambda r: r.randint(-30, 30))),
    Family("max_of_three", _const(_pick("max_of_three", "largest_of_three", "biggest")), "a: int, b: int, c: int",
           "int", lambda c: "Return the largest of a, b and c.", lambda c, a, b, d: max(a, b, d),
           lambda r, c: (r.randint(-20, 20), r.randint(-20, 20), r.randint(-20, 20))),
    Family("sum_digits", _const(_pick("sum_digits", "digit_sum", "add_digits")), "n: int", "int",
           lambda c: "Return the sum of the decimal digits of the non-negative integer n.",
           lambda c, n: sum(int(d) for d in str(n)), _one(lambda r: r.randint(0, 99999))),
    Family("count_digits", _const(_pick("count_digits", "num_digits", "digit_count")), "n: int", "int",
           lambda c: "Return how many decimal digits the non-negative integer n has.",
           lambda c, n: len(str(n)), _one(lambda r: r.randint(0, 10 ** r.randint(0, 7)))),
    Family("factorial", _const(_pick("factorial", "fact", "product_up_to")), "n: int", "int",
           lambda c: "Return n factorial (1 * 2 * ... * n); 0 factorial is 1.",
           lambda c, n: math.factorial(n), _one(lambda r: r.randint(0, 10))),
    Family("fibonacci", _const(_pick("fibonacci", "fib", "nth_fibonacci")), "n: int", "int",
           lambda c: "Return the n-th Fibonacci number, where fib(0) = 0 and fib(1) = 1.",
           lambda c, n: (lambda f: f(f, n))(lambda f, k: k if k < 2 else f(f, k - 1) + f(f, k - 2)),
           _one(lambda r: r.randint(0, 15))),
    Family("is_prime", _const(_pick("is_prime", "prime", "check_prime")), "n: int", "bool",
           lambda c: "Return True if n is a prime number, otherwise False.", lambda c, n: _is_prime(n),
           _one(lambda r: r.randint(-3, 60))),
    Family("gcd", _const(_pick("gcd", "greatest_common_divisor", "common_divisor")), "a: int, b: int", "int",
           lambda c: "Return the greatest common divisor of two positive integers a and b.",
           lambda c, a, b: math.gcd(a, b), lambda r, c: (r.randint(1, 120), r.randint(1, 120))),
    Family("sum_list", _const(_pick("sum_list", "total", "add_all")), "nums: list[int]", "int",
           lambda c: "Return the sum of the numbers in nums (0 for an empty list).", lambda c, nums: sum(nums),
           _one(_ints)),
    Family("product_list", _const(_pick("product", "multiply_all", "list_product")), "nums: list[int]", "int",
           lambda c: "Return the product of the numbers in nums (1 for an empty list).",
           lambda c, nums: math.prod(nums), _one(lambda r: _ints(r, -5, 5))),
    Family("max_list", _const(_pick("max_element", "largest", "find_max")), "nums: list[int]", "int",
           lambda c: "Return the largest number in the non-empty list nums.", lambda c, nums: max(nums),
           _one(lambda r: _ints(r, size=(1, 7)))),
    Family("min_list", _const(_pick("min_element", "smallest", "find_min")), "nums: list[int]", "int",
           lambda c: "Return the smallest number in the non-empty list nums.", lambda c, nums: min(nums),
           _one(lambda r: _ints(r, size=(1, 7)))),
    Family("sum_even", _const(_pick("sum_even", "sum_of_evens", "add_evens")), "nums: list[int]", "int",
           lambda c: "Return the sum of the even numbers in nums.", lambda c, nums: sum(x for x in nums if x % 2 == 0),
           _one(_ints)),
    Family("count_above", _const(_pick("count_above", "count_greater", "how_many_above"), t=(-5, 10)),
           "nums: list[int]", "int", lambda c: f"Return how many numbers in nums are greater than {c['t']}.",
           lambda c, nums: sum(x > c["t"] for x in nums),
           # Half of the lists hold the threshold itself, so ">=" for ">" fails a test.
           lambda r, c: (r.sample(nums := _ints(r) + [c["t"]] * r.randint(0, 1), len(nums)),)),
    Family("count_value", _const(_pick("count_value", "occurrences", "count_of")), "nums: list[int], value: int",
           "int", lambda c: "Return how many times value occurs in nums.", lambda c, nums, v: nums.count(v),
           lambda r, c: (_ints(r, 0, 4), r.randint(0, 4))),
    Family("keep_positive", _const(_pick("keep_positive", "positives", "filter_positive")), "nums: list[int]",
           "list[int]", lambda c: "Return the positive numbers of nums (greater than 0), in their order.",
           lambda c, nums: [x for x in nums if x > 0], _one(_ints)),
    Family("square_all", _const(_pick("square_all", "squares", "square_each")), "nums: list[int]", "list[int]",
           lambda c: "Return a list with the square of each number of nums, in order.",
           lambda c, nums: [x * x for x in nums], _one(_ints)),
    Family("add_to_each", _const(_pick("add_to_each", "shift_all", "increment_all"), k=(1, 9)),
           "nums: list[int]", "list[int]", lambda c: f"Return a list with {c['k']} added to each number of nums.",
           lambda c, nums: [x + c["k"] for x in nums], _one(_ints)),
    Family("reverse_list", _const(_pick("reverse_list", "reversed_list", "backwards")), "nums: list[int]",
           "list[int]", lambda c: "Return a new list with the elements of nums in reverse order.",
           lambda c, nums: nums[::-1], _one(_ints)),
    Family("sort_descending", _const(_pick("sort_descending", "sort_desc", "largest_first")), "nums: list[int]",
           "list[int]", lambda c: "Return the numbers of nums sorted from largest to smallest.",
           lambda c, nums: sorted(nums, reverse=True), _one(_ints)),
    Family("unique_in_order", _const(_pick("unique", "remove_duplicates", "dedupe")), "nums: list[int]",
           "list[int]", lambda c: "Return nums without repeated values, keeping the first occurrence of each "
                                  "value in its original order.",
           lambda c, nums: list(dict.fromkeys(nums)), _one(lambda r: _ints(r, 0, 5, (0, 9)))),
    Family("index_of_max", _const(_pick("index_of_max", "argmax", "position_of_largest")), "nums: list[int]",
           "int", lambda c: "Return the index of the largest number in the non-empty list nums (the first one "
                            "if it occurs more than once).",
           lambda c, nums: nums.index(max(nums)), _one(lambda r: _ints(r, 0, 9, (1, 7)))),
    Family("average", _const(_pick("average", "mean", "arithmetic_mean")), "nums: list[int]", "float",
           lambda c: "Return the average (arithmetic mean) of the non-empty list nums.",
           lambda c, nums: sum(nums) / len(nums), _one(lambda r: _ints(r, size=(1, 6)))),
    Family("running_sum", _const(_pick("running_sum", "prefix_sums", "cumulative_sum")), "nums: list[int]",
           "list[int]", lambda c: "Return the running sums of nums: element i is nums[0] + ... + nums[i].",
           lambda c, nums: [sum(nums[: i + 1]) for i in range(len(nums))], _one(_ints)),
    Family("reverse_string", _const(_pick("reverse_string", "reverse_text", "backwards_string")), "s: str", "str",
           lambda c: "Return the string s reversed.", lambda c, s: s[::-1], _one(_text)),
    Family("count_vowels", _const(_pick("count_vowels", "vowel_count", "num_vowels")), "s: str", "int",
           lambda c: "Return how many vowels (a, e, i, o, u) the lowercase string s contains.",
           lambda c, s: sum(ch in "aeiou" for ch in s), _one(_text)),
    Family("count_char", _const(_pick("count_char", "char_count", "occurrences_of")), "s: str, ch: str", "int",
           lambda c: "Return how many times the character ch occurs in s.", lambda c, s, ch: s.count(ch),
           lambda r, c: (_text(r), r.choice("aeiost"))),
    Family("is_palindrome", _const(_pick("is_palindrome", "palindrome", "reads_same_backwards")), "s: str", "bool",
           lambda c: "Return True if s reads the same forwards and backwards, otherwise False.",
           lambda c, s: s == s[::-1], _one(lambda r: r.choice(["level", "noon", "abcba", "", "x"]) if r.random()
                                           < 0.5 else _word(r))),
    Family("first_chars", _const(_pick("first_chars", "prefix", "head"), n=(1, 4)), "s: str", "str",
           lambda c: f"Return the first {c['n']} characters of s (all of s if it is shorter).",
           lambda c, s: s[: c["n"]], _one(_text)),
    Family("last_chars", _const(_pick("last_chars", "suffix", "tail"), n=(1, 4)), "s: str", "str",
           lambda c: f"Return the last {c['n']} characters of s (all of s if it is shorter).",
           lambda c, s: s[-c["n"]:] if s else s, _one(_text)),
    Family("repeat_string", _const(_pick("repeat", "repeat_string", "copies")), "s: str, n: int", "str",
           lambda c: "Return s repeated n times.", lambda c, s, n: s * n,
           lambda r, c: (_word(r)[: r.randint(1, 4)], r.randint(0, 4))),
    Family("shout", _const(_pick("shout", "to_upper", "uppercase")), "s: str", "str",
           lambda c: "Return s in upper case, followed by an exclamation mark.", lambda c, s: s.upper() + "!",
           _one(_sentence)),
    Family("word_count", _const(_pick("word_count", "count_words", "num_words")), "s: str", "int",
           lambda c: "Return the number of words in s (words are separated by spaces).",
           lambda c, s: len(s.split()), _one(_sentence)),
    Family("longest_word", _const(_pick("longest_word", "longest", "biggest_word")), "s: str", "str",
           lambda c: "Return the longest word of the non-empty sentence s (the first one if there is a tie).",
           lambda c, s: max(s.split(), key=len), _one(_sentence)),
    Family("capitalize_words", _const(_pick("capitalize_words", "title_words", "capitalize_each")), "s: str",
           "str", lambda c: "Return s with the first letter of every word in upper case (words are separated "
                            "by single spaces).",
           lambda c, s: " ".join(w[:1].upper() + w[1:] for w in s.split(" ")), _one(_sentence)),
    Family("replace_char", _const(_pick("replace_char", "swap_char", "substitute"), i=(0, 4)), "s: str", "str",
           lambda c: f"Return s with every '{'aeiou'[c['i']]}' replaced by '*'.",
           lambda c, s: s.replace("aeiou"[c["i"]], "*"), _one(_sentence)),
    Family("join_words", _const(_pick("join_words", "join_with", "glue"), i=(0, 3)), "words: list[str]", "str",
           lambda c: f"Return the words joined into one string, separated by {repr(['-', ', ', '_', ' + '][c['i']])}.",
           lambda c, words: ["-", ", ", "_", " + "][c["i"]].join(words),
           _one(lambda r: [_word(r) for _ in range(r.randint(0, 4))])),
    Family("starts_with", _const(_pick("starts_with", "has_prefix", "begins_with"), i=(0, 19)), "s: str", "bool",
           lambda c: f"Return True if s starts with {_WORDS[c['i']][:2]!r}, otherwise False.",
           lambda c, s: s.startswith(_WORDS[c["i"]][:2]),
           lambda r, c: (r.choice([_WORDS[c["i"]], _word(r), _WORDS[c["i"]][:2] + _text(r)]),)),
]


def _render(family: Family, name: str, constants: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    def call(args: tuple) -> str:
        return f"{name}({', '.join(repr(a) for a in args)})"

    cases: list[tuple] = []
    tries = 0
    while len(cases) < EXAMPLES_PER_PROBLEM + TESTS_PER_PROBLEM and tries < 200:
        tries += 1
        args = family.inputs(rng, constants)
        if args not in cases:  # distinct tests; a family with few inputs just gets fewer
            cases.append(args)
    examples = "".join(
        f"    >>> {call(args)}\n    {family.solve(constants, *args)!r}\n" for args in cases[:EXAMPLES_PER_PROBLEM]
    )
    prompt = (
        f"def {name}({family.params}) -> {family.returns}:\n"
        f'    """{family.describe(constants)}\n\n{examples}    """\n'
    )
    asserts = []
    for args in cases:
        expected = family.solve(constants, *args)
        arguments = ", ".join(repr(a) for a in args)
        if isinstance(expected, float):
            asserts.append(f"    assert abs(candidate({arguments}) - {expected!r}) < 1e-6")
        else:
            asserts.append(f"    assert candidate({arguments}) == {expected!r}")
    return {"prompt": prompt, "entry_point": name, "test": "def check(candidate):\n" + "\n".join(asserts) + "\n"}


def instance_rng(family: str, instance: int) -> random.Random:
    """The random generator of one problem: seeded by (family, instance) only, so adding a family or an
    instance never changes the others."""
    return random.Random(f"{SOURCE}/{family}/{instance}")


def generate_rows(instances: int = INSTANCES_PER_FAMILY) -> list[dict[str, Any]]:
    """Every problem, in family order: HumanEval-style rows plus `task_id` ("pytasks/<family>/<i>") and
    `family` (the split key). Duplicates (a family with few distinct constants) are dropped."""
    rows, seen = [], set()
    for family in FAMILIES:
        for instance in range(instances):
            rng = instance_rng(family.name, instance)
            name, constants = family.make(rng)
            row = _render(family, name, constants, rng)
            if row["prompt"] in seen:
                continue
            seen.add(row["prompt"])
            rows.append(row | {"task_id": f"{SOURCE}/{family.name}/{instance}", "family": family.name})
    return rows
