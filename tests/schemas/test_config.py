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


def test_bypass_with_rollout_correction_is_verls_recipe() -> None:
    # verl's most used off-policy recipe: bypass_mode with token IS 2.0 and rollout_rs token_k1,seq_max_k2 with
    # thresholds 0.6_1.6,2.5 (under bypass the correction compares pi_theta with the sampler)
    config = load_config(None, ["train.bypass_old_logprobs=true", "train.is_level=token", "train.is_threshold=2.0",
                                "train.rejection=[token_k1,seq_max_k2]",
                                "train.rejection_thresholds=['0.6_1.6','2.5']"])
    assert config.train.rejection_rules() == [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 2.5)]
    # one threshold is shared by every rule; a k1 rule given one number u keeps [1/u, u]
    shared = load_config(None, ["train.rejection=[token_k1,seq_mean_k1]", "train.rejection_thresholds=['2']"])
    assert shared.train.rejection_rules() == [("token_k1", 0.5, 2.0), ("seq_mean_k1", 0.5, 2.0)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.rejection=[token_k1,seq_max_k2]", "train.rejection_thresholds=['2','3','4']"], "3 entries for 2"),
        (["train.rejection=[seq_max_k2]", "train.rejection_thresholds=['0.5_2']"], "one upper bound"),
        (["train.rejection=[token_k1]", "train.rejection_thresholds=['2_0.5']"], "keeps nothing"),
        (["train.rejection=[token_k1]", "train.rejection_thresholds=[x_2]"], "is not a number"),
        # unquoted, YAML reads 0.5_2 as the number 0.52: refused rather than taken as a bound
        (["train.rejection=[seq_max_k2]", "train.rejection_thresholds=[0.5_2]"], "valid string"),
    ],
)
def test_bad_rejection_thresholds_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match="train.rejection_thresholds") as error:
        load_config(None, overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "training",
    [["train.is_level=token"], ["train.rejection=[token_k1]"], ["train.bypass_old_logprobs=true"],
     ["train.epochs=2"], ["train.minibatches=2"]],
)
@pytest.mark.parametrize("sampling", [["generate.top_p=0.95"], ["generate.top_k=50"]])
def test_truncated_sampling_with_off_policy_training_is_refused(sampling: list[str], training: list[str]) -> None:
    # the sampler's logprobs are of the top-p/top-k truncated distribution: every ratio to them is off by 1/Z
    with pytest.raises(ConfigError, match="kept probability mass Z") as error:
        load_config(None, [*sampling, *training])
    assert sampling[0] in str(error.value) and training[0].split("=")[0] in str(error.value)
    # each alone is fine: one on-policy step never compares the two distributions
    assert load_config(None, sampling).generate.top_p <= 1.0
    assert load_config(None, training).generate.top_p == 1.0


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "deployments" / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_configs_load_and_their_data_sources_resolve(path: Path) -> None:
    from stages.data.sources import validate_sources

    config = load_config(str(path))
    validate_sources(config.data)
