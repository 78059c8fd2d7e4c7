"""The run config: defaults that validate, YAML + overrides, and errors that name the field."""

from pathlib import Path

import pytest

from schemas.config import ConfigError, RunConfig, dump_config, load_config
from storage.layout import RunLayout
from storage.run import read_run_config


def test_defaults_validate_and_every_section_has_defaults() -> None:
    config = load_config()
    assert config == RunConfig()
    assert config.iterations == 2 and config.train.lr > 0


def test_yaml_and_overrides_are_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("run_id: r1\ntrain:\n  lr: 3.0e-5\n")
    config = load_config(path, ["train.lr=1e-5", 'generate.stop=["\\n\\n"]', "data.max_test_prompts=null"])
    assert config.run_id == "r1"
    assert config.train.lr == pytest.approx(1e-5)
    assert config.generate.stop == ["\n\n"]
    assert config.data.max_test_prompts is None


def test_unknown_key_names_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(path) in str(error.value) and "train.lrr" in str(error.value)


def test_a_runs_stored_config_reads_back_or_names_its_file(tmp_path: Path) -> None:
    """Proves: the config a run stored reads back equal to the one written; a run with no config, with a
    config that is not YAML, or one that is not a mapping, is a ConfigError naming the run's config file."""
    layout = RunLayout.create(str(tmp_path), "r")
    with pytest.raises(ConfigError, match=rf"run r has no config at {layout.config_path}: start it with"):
        read_run_config(layout)
    config = load_config(None, ["run_id=r", "train.lr=1e-5"])
    Path(layout.config_path).parent.mkdir(parents=True)
    Path(layout.config_path).write_text(dump_config(config))
    assert read_run_config(layout) == config
    Path(layout.config_path).write_text("train: [1,\n")
    with pytest.raises(ConfigError, match=rf"(?s)config file {layout.config_path} is not valid YAML: .*line 2"):
        read_run_config(layout)
    Path(layout.config_path).write_text("- a list\n")
    with pytest.raises(ConfigError, match=rf"config file {layout.config_path} must hold a mapping"):
        read_run_config(layout)


def test_wrong_type_names_field() -> None:
    with pytest.raises(ConfigError, match=r"generate\.n_samples"):
        load_config(None, ["generate.n_samples=many"])


@pytest.mark.parametrize("run_id", ["a/b", "../x", "", "a b"])
def test_run_id_with_path_separators_is_rejected(run_id: str) -> None:
    with pytest.raises(ConfigError, match="run_id"):
        load_config(None, [f"run_id={run_id!r}"])


def test_section_digest_changes_only_with_its_section() -> None:
    a, b = RunConfig(), load_config(None, ["train.lr=0.5"])
    assert a.train.digest() != b.train.digest()
    assert a.generate.digest() == b.generate.digest()


@pytest.mark.parametrize(
    "correction",
    [
        ["train.rejection=[token_k1]"],
        ["train.is_level=sequence"],
        ["train.rejection=[seq_max_k2]", "train.is_level=token"],
    ],
)
def test_bypass_with_rollout_correction_is_refused(correction: list[str]) -> None:
    # under bypass pi_old is the sampler, so pi_old / pi_sampler = 1: IS weights and rejection would be ignored
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.bypass_old_logprobs=true", *correction])
    message = str(error.value)
    assert "  train: " in message  # the section the error belongs to, then the fields it names
    assert "train.bypass_old_logprobs with train.rejection / train.is_level" in message
    # each alone is fine
    assert load_config(None, ["train.bypass_old_logprobs=true"]).train.bypass_old_logprobs
    assert load_config(None, correction).train.bypass_old_logprobs is False


def test_bypass_with_correction_is_refused_on_assignment_too() -> None:
    config = load_config(None, ["train.bypass_old_logprobs=true"])
    with pytest.raises(ValueError, match=r"train\.bypass_old_logprobs with train\.rejection"):
        config.train.is_level = "token"


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "deployments" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_load_and_their_data_sources_resolve(path: Path) -> None:
    from stages.data.sources import validate_sources

    config = load_config(str(path))
    validate_sources(config.data)
