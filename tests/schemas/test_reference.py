"""The configuration reference: docs/configuration.md is the generated text, and every field is described."""

from pathlib import Path

from pydantic import BaseModel

from schemas.config import RunConfig
from schemas.reference import REGENERATE, config_reference, sections
from schemas.settings import VARIABLES

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_configuration_is_the_generated_reference() -> None:
    assert DOC.exists(), f"docs/configuration.md is missing: run `{REGENERATE}`"
    assert DOC.read_text() == config_reference(), (
        f"docs/configuration.md is out of date with schemas/config.py or schemas/settings.py: run `{REGENERATE}`"
    )


def test_every_field_and_section_is_described() -> None:
    models: list[tuple[str, type[BaseModel]]] = [("", RunConfig), *((f"{key}.", m) for key, m in sections())]
    undescribed = [
        f"{prefix}{name}"
        for prefix, model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert not undescribed, f"fields without Field(description=...) in schemas/config.py: {undescribed}"
    assert [key for key, model in sections() if not (model.__doc__ or "").strip()] == []


def test_rows_read_as_written_by_hand() -> None:
    """Type, bounds and default of a few fields, as a user reads them in the YAML (written out here by hand)."""
    reference = config_reference()
    assert "| `score.workers` | `int (>= 1, <= 64)` | `4` |" in reference
    assert '| `generate.backend` | `"auto" \\| "hf" \\| "vllm"` | `"auto"` |' in reference
    assert "| `data.max_test_prompts` | `int \\| null (>= 1)` | `8` |" in reference
    assert "| `evaluate.k` | `list[int]` | `[1, 4]` |" in reference
    assert "| `train.dual_clip` | `float \\| null (> 1)` | `3.0` |" in reference
    assert "## `advantage`" in reference and "| `advantage.target_groups` |" in reference
    # Sections are tables of their own, not rows of the run table.
    assert "| `train` |" not in reference


def test_every_environment_variable_is_listed() -> None:
    reference = config_reference()
    for variable in VARIABLES:
        assert f"| `{variable.name}` |" in reference
    assert "| `RLPIPE_DISPATCH` | `local` |" in reference and "| `RLPIPE_ROOT` | unset |" in reference
