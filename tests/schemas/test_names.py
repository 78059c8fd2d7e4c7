"""Names people already know (schemas/names.py): docs/names.md is the generated table, every rlpipe field it names
exists, and a TRL or verl key in a config or an override is refused with a hint naming rlpipe's field."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.config import ConfigError, config_fields, load_config
from schemas.names import NAMES, TRL_KEYS, VERL_KEYS, names_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "names.md"


def test_docs_names_is_the_generated_table() -> None:
    regenerate = ".venv/bin/python -m schemas.names > docs/names.md"
    assert DOC.read_text() == names_markdown(), f"docs/names.md is stale: run `{regenerate}`"


def test_every_rlpipe_field_named_exists_and_no_peer_key_is_an_rlpipe_field() -> None:
    fields = set(config_fields())
    assert "generate.n_samples" in fields and "train.lr" in fields and "iterations" in fields
    assert [name.rlpipe for name in NAMES if name.rlpipe not in fields] == []
    # A peer key that were also rlpipe's would be accepted with rlpipe's meaning, silently.
    assert [key for key in (*TRL_KEYS, *VERL_KEYS) if key in fields and key != "seed"] == []


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("num_generations=8", "did you mean generate.n_samples? (num_generations is TRL's GRPOConfig name for it)"),
        ("actor_rollout_ref.rollout.n=8", "did you mean generate.n_samples? (actor_rollout_ref.rollout.n is verl's"),
        ("train.learning_rate=1e-6", "did you mean train.lr? (learning_rate is TRL's GRPOConfig name for it)"),
        # verl's `data.` keys land in rlpipe's data section: still recognised
        ("data.max_prompt_length=512", "did you mean generate.max_prompt_tokens? (data.max_prompt_length is verl's"),
        ("beta=0.04", "did you mean train.kl_coef?"),
        ("trainer.total_training_steps=3", "did you mean iterations? (trainer.total_training_steps is verl's name for "
                                           "it; an rlpipe iteration is one generate-score-train round"),
        ("n_samples=8", "did you mean generate.n_samples?"),  # rlpipe's own name, in the wrong section
        ("train.lrr=0.1", "did you mean train.lr?"),  # a misspelling
    ],
)
def test_peer_names_in_overrides_get_a_hint(override: str, hint: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert hint in str(error.value)


def test_nested_verl_keys_in_a_config_file_get_a_hint(tmp_path: Path) -> None:
    config = tmp_path / "verl.yaml"
    config.write_text("actor_rollout_ref:\n  rollout:\n    n: 8\n    temperature: 0.7\n  actor:\n    optim:\n"
                      "      lr: 1.0e-6\n")
    with pytest.raises(ConfigError) as error:
        load_config(config)
    text = str(error.value)
    assert "did you mean generate.n_samples?" in text
    assert "did you mean generate.temperature?" in text
    assert "did you mean train.lr? (actor_rollout_ref.actor.optim.lr is verl's name for it)" in text


def test_unknown_key_without_a_likely_meaning_gets_no_hint() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["quantum_flux=3"])
    assert "did you mean" not in str(error.value)
