"""generate.multi_turn: defaults are single-turn, combinations that cannot work are refused at load naming the
fields, and the conversation budget is what the engine's context and the contract use."""

from __future__ import annotations

import pytest

from schemas.config import ConfigError, load_config


def test_defaults_are_single_turn() -> None:
    config = load_config(None)
    assert config.generate.multi_turn.mode == "off"
    assert config.generate.response_token_limit == config.generate.max_new_tokens == 96


def test_a_bare_off_turns_multi_turn_off_as_in_yaml_files() -> None:
    # `--set generate.multi_turn.mode=off` reaches the model as False (YAML 1.1); the recipe's word is meant
    recipe = "deployments/configs/code-feedback-cpu.yaml"
    assert load_config(recipe).generate.multi_turn.mode == "feedback"
    assert load_config(recipe, ["generate.multi_turn.mode=off"]).generate.multi_turn.mode == "off"
    with pytest.raises(ConfigError, match="generate.multi_turn.mode.*got 'on'"):
        load_config(None, ["generate.multi_turn.mode=on"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["generate.multi_turn.mode=tool", "generate.multi_turn.max_tool_calls=0"], "never runs a tool"),
    (["generate.multi_turn.mode=feedback", "generate.multi_turn.max_turns=1"], "no turn after the first"),
    (["generate.multi_turn.mode=tool", "generate.vllm_max_model_len=1000"],
     "max_prompt_tokens \\+ multi_turn.max_response_tokens = 1280"),
    (["generate.multi_turn.mode=chat"], "generate.multi_turn.mode"),
    (["generate.multi_turn.tool_timeout_s=0"], "generate.multi_turn.tool_timeout_s"),
])
def test_bad_combinations_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_budget_is_the_response_limit_when_multi_turn() -> None:
    config = load_config(None, ["generate.multi_turn.mode=tool", "generate.multi_turn.max_response_tokens=300"])
    assert config.generate.response_token_limit == 300
    # off: the budget is not used, max_new_tokens is the limit again
    assert load_config(None, ["generate.multi_turn.max_response_tokens=300"]).generate.response_token_limit == 96
