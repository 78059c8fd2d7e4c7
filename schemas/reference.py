"""The configuration reference (docs/configuration.md), generated from the pydantic model and the settings.

Every field's description lives on the field itself (schemas/config.py), so the reference cannot drift from
the code: `python -m schemas.reference > docs/configuration.md` rewrites it and tests/schemas/test_reference.py
fails when the file and the model disagree. One markdown table per section (field, type with its bounds,
default, description), then the `RLPIPE_*` environment variables of schemas/settings.py.
"""

from __future__ import annotations

import json
import types
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from schemas.config import RunConfig
from schemas.settings import VARIABLES

REGENERATE = ".venv/bin/python -m schemas.reference > docs/configuration.md"

_BOUNDS = ((annotated_types.Ge, "ge", ">="), (annotated_types.Gt, "gt", ">"), (annotated_types.Le, "le", "<="),
           (annotated_types.Lt, "lt", "<"))


def type_name(annotation: Any) -> str:  # noqa: ANN401 - any typing form
    """A YAML user's reading of a type: `"a" | "b"` for a Literal, `null` for None, `list[int]`."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(value) for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in get_args(annotation))
    if origin is list:
        return f"list[{type_name(get_args(annotation)[0])}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def bounds(field: FieldInfo) -> str:
    """The field's numeric bounds, e.g. `>= 1, <= 64` (empty when it has none)."""
    found = []
    for item in field.metadata:
        for kind, attribute, symbol in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{symbol} {getattr(item, attribute)}")
    return ", ".join(found)


def default_text(field: FieldInfo) -> str:
    """The default as it would be written in YAML (JSON scalars and lists)."""
    return json.dumps(field.get_default(call_default_factory=True))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_table(model: type[BaseModel], prefix: str) -> list[str]:
    """A markdown table of `model`'s plain fields (sections nested in it get their own table)."""
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        kind = type_name(field.annotation) + (f" ({bounds(field)})" if bounds(field) else "")
        lines.append(f"| `{prefix}{name}` | `{_cell(kind)}` | `{_cell(default_text(field))}` | "
                     f"{_cell(field.description or '')} |")
    return lines


def sections() -> list[tuple[str, type[BaseModel]]]:
    """(YAML key, model) of each section of RunConfig, in declaration order."""
    return _nested_sections(RunConfig, "")


def _nested_sections(model: type[BaseModel], prefix: str) -> list[tuple[str, type[BaseModel]]]:
    """(dotted key, model) of each section of `model`, each followed by the sections nested in it."""
    found = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found.append((prefix + name, field.annotation))
            found += _nested_sections(field.annotation, f"{prefix}{name}.")
    return found


def config_reference() -> str:
    """The whole reference as markdown: run-level fields, one table per section, then environment variables."""
    lines = [
        "# Configuration reference",
        "",
        f"Generated from `schemas/config.py` and `schemas/settings.py` by `{REGENERATE}`; do not edit by hand.",
        "",
        "A run's config is a YAML file (`rlpipe run --config FILE`) with the sections below; every field has a "
        "default that runs on a 2-core CPU, and unknown keys are errors. Any field can be overridden on the "
        "command line with `--set section.field=value` (the value is parsed as YAML: `--set train.lr=3e-6`, "
        "`--set data.max_test_prompts=null`). Example: `deployments/configs/default.yaml`. How the parts fit "
        "together (backends, data sources, dynamic sampling): [usage.md](usage.md).",
        "",
        "## Run",
        "",
        (RunConfig.__doc__ or "").strip(),
        "",
        *section_table(RunConfig, ""),
    ]
    for key, model in sections():
        lines += ["", f"## `{key}`", "", (model.__doc__ or "").strip(), "", *section_table(model, f"{key}.")]
    lines += [
        "",
        "## Environment variables",
        "",
        "The machine's settings, not the run's: read when used, never stored with a run.",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
    ]
    for variable in VARIABLES:
        default = f"`{variable.default}`" if variable.default is not None else "unset"
        lines.append(f"| `{variable.name}` | {default} | {_cell(variable.meaning)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(config_reference(), end="")
