"""A run as one value: where it lives and the config it was started with, loaded once and passed down.

A process opens a run once, where it enters: the command line (`rlpipe run/resume/status/stage`), a stage
process (stages/harness.py) and a Prefect flow run on a worker. Everything after takes the `Run`. A Prefect
flow parameter carries a run as a `RunRef` (root and run id, JSON for a deployment); in the process that
already drives the run, the ref also hands the flow that `Run` itself (`RunRef.driving`), so its config is
not read again there. `resolve_root` is the one rule that turns a root argument, `$RLPIPE_ROOT` or a
config's `root:` into a storage root; where a run is stored is not part of its config.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import fsspec
from pydantic import BaseModel, ConfigDict, PrivateAttr

from schemas import settings
from schemas.config import ConfigError, RunConfig, config_from_yaml, dump_config, read_yaml
from storage.fs import atomic_write_bytes
from storage.layout import RunLayout


def resolve_root(explicit: str | None = None, config: RunConfig | None = None) -> str:
    """The storage root: the argument, else `$RLPIPE_ROOT`, else the config's `root:`, else ./rlpipe-data."""
    return explicit or settings.ROOT.get() or (config.root if config is not None else settings.DEFAULT_ROOT)


def _what_runs(config_text: str) -> dict[str, Any]:
    """A config.yaml without `root:`: a run moved or copied to another storage root is the same run."""
    values = read_yaml(config_text)
    values.pop("root", None)
    return values


def read_run_config(layout: RunLayout) -> RunConfig:
    """The config a run was started with (`runs/<run_id>/config.yaml`, local or on S3)."""
    try:
        text = layout.fs.cat_file(layout.config_path)
    except FileNotFoundError:
        raise ConfigError(
            f"run {layout.run_id} has no config at {layout.config_path}: start it with `rlpipe run`"
        ) from None
    return config_from_yaml(text, layout.config_path)


@dataclass(frozen=True)
class Run:
    layout: RunLayout
    config: RunConfig

    @classmethod
    def open(cls, root: str | None, run_id: str) -> Run:
        """An existing run (its config read once); a ConfigError when it was never started."""
        return cls.at(RunLayout.create(resolve_root(root), run_id))

    @classmethod
    def at(cls, layout: RunLayout) -> Run:
        """The run that lives at `layout`, its config read now."""
        return cls(layout, read_run_config(layout))

    @classmethod
    def start(cls, config: RunConfig, root: str | None = None, replace_config: bool = False) -> Run:
        """Write the run's config.yaml, or check that the existing one is the same run (`replace_config`: a
        deliberate change, as `rlpipe resume --set` makes)."""
        layout = RunLayout.create(resolve_root(root, config), config.run_id)
        text = dump_config(config)
        if layout.fs.exists(layout.config_path) and not replace_config:
            existing = layout.fs.cat_file(layout.config_path).decode()
            if _what_runs(existing) != _what_runs(text):
                raise ConfigError(
                    f"run {config.run_id} already exists at {layout.run_dir} with a different config; "
                    f"use `rlpipe resume {config.run_id} --set section.field=value` to change it deliberately "
                    "(changed stages and everything downstream of them are redone)"
                )
            return cls(layout, config)
        atomic_write_bytes(layout.fs, layout.config_path, text.encode())
        return cls(layout, config)

    @property
    def root(self) -> str:
        return self.layout.root

    @property
    def run_id(self) -> str:
        return self.layout.run_id

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.layout.fs


class RunRef(BaseModel):
    """A run as a Prefect flow parameter: its storage root and id, all a flow run in another process needs to
    open it. `RunRef.driving(run)` is made by the process that drives the run already (`rlpipe run`: the `Run`
    open, the run lease held) and hands that `Run` to the flow it calls in memory; it is never serialized."""

    model_config = ConfigDict(frozen=True)
    root: str
    run_id: str
    _driven: Run | None = PrivateAttr(default=None)

    @classmethod
    def driving(cls, run: Run) -> RunRef:
        ref = cls(root=run.root, run_id=run.run_id)
        ref._driven = run
        return ref

    @property
    def driven(self) -> Run | None:
        """The `Run` this process drives already (its lease held), or None where the flow run opens it."""
        return self._driven

    @property
    def layout(self) -> RunLayout:
        return RunLayout.create(self.root, self.run_id)
