"""`stages.generation.sampling.encode_prompts`: prompts longer than `max_prompt_tokens` are skipped or cut, and counted.

Pure logic, so a fake tokenizer stands in for the model's: its chat template turns a prompt into token ids
0..n-1 (n from the message), which makes "which end was kept" visible in the ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from stages.generation.sampling import encode_prompts


class FakeTokenizer:
    """`apply_chat_template` like a Hugging Face tokenizer's: the message content "n" becomes ids 0..n-1."""

    def __init__(self, batch_encoding: bool = False) -> None:
        self.batch_encoding = batch_encoding
        self.calls: list[dict] = []

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool,  # noqa: ANN201
                            tools: list[dict] | None = None):
        self.calls.append({"add_generation_prompt": add_generation_prompt, "tokenize": tokenize})
        ids = list(range(int(messages[0]["content"])))
        return FakeBatchEncoding(ids) if self.batch_encoding else ids


class FakeBatchEncoding(dict):
    """What newer transformers return: a mapping with `input_ids`, also readable as an attribute."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__(input_ids=ids)
        self.input_ids = ids


def messages(lengths: Sequence[int]) -> list[str]:
    return [json.dumps([{"role": "user", "content": str(n)}]) for n in lengths]


LENGTHS = [3, 10, 6, 7]  # limit 6: "b" and "d" are too long; "c" is exactly at the limit and fits
IDS = ["a", "b", "c", "d"]


def test_skip_drops_overlong_prompts_and_counts_them() -> None:
    tokenizer = FakeTokenizer()
    encoded = encode_prompts(tokenizer, IDS, messages(LENGTHS), max_prompt_tokens=6, overlong="skip")
    assert encoded.prompt_ids == ["a", "c"]
    assert encoded.token_ids == [[0, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert (encoded.skipped, encoded.truncated) == (2, 0)
    # Every prompt is chat-formatted with the generation prompt, as token ids.
    assert tokenizer.calls == [{"add_generation_prompt": True, "tokenize": True}] * 4


def test_truncate_keeps_every_prompt_cut_from_the_left() -> None:
    encoded = encode_prompts(FakeTokenizer(), IDS, messages(LENGTHS), max_prompt_tokens=6, overlong="truncate")
    assert encoded.prompt_ids == IDS
    # The end survives (the instruction and the generation prompt are there): ids n-6..n-1.
    assert encoded.token_ids == [[0, 1, 2], [4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
    assert all(len(ids) <= 6 for ids in encoded.token_ids)
    assert (encoded.skipped, encoded.truncated) == (0, 2)


@pytest.mark.parametrize("overlong", ["skip", "truncate"])
def test_nothing_overlong_changes_nothing(overlong: str) -> None:
    encoded = encode_prompts(FakeTokenizer(), IDS, messages(LENGTHS), max_prompt_tokens=10, overlong=overlong)
    assert encoded.prompt_ids == IDS
    assert [len(ids) for ids in encoded.token_ids] == LENGTHS
    assert (encoded.skipped, encoded.truncated) == (0, 0)


def test_every_prompt_overlong_skips_all_without_failing() -> None:
    encoded = encode_prompts(FakeTokenizer(), IDS, messages(LENGTHS), max_prompt_tokens=2, overlong="skip")
    assert (encoded.prompt_ids, encoded.token_ids) == ([], [])
    assert (encoded.skipped, encoded.truncated) == (4, 0)


def test_batch_encoding_results_are_read_as_input_ids() -> None:
    encoded = encode_prompts(FakeTokenizer(batch_encoding=True), IDS, messages(LENGTHS), max_prompt_tokens=6,
                             overlong="truncate")
    assert encoded.token_ids[1] == [4, 5, 6, 7, 8, 9]
    assert all(type(ids) is list for ids in encoded.token_ids)
    assert encoded.truncated == 2
