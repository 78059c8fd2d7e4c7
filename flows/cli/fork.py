"""`rlpipe fork RUN NEW --at K [--set section.field=value ...] [--config FILE]`: run NEW shares RUN's outputs up to
iteration K that its config leaves unchanged (flows/fork.py), then computes the rest as `rlpipe resume` would.

NEW's config is RUN's (or FILE's, with --config) with the --set overrides and run id NEW, checked as `rlpipe run`
checks a config. Bad input (RUN missing, NEW existing, no iteration K) is one line and exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from schemas.config import apply_overrides, load_config, parse_config
from storage.run import Run


def cmd_fork(args: argparse.Namespace) -> int:
    from flows.cli.commands import _check_model, _drive, _validate_data, console
    from flows.fork import check_fork, fork

    source = Run.open(args.root, args.run)
    if args.config is not None:
        values, where = load_config(args.config, args.set).model_dump(mode="json"), str(args.config)
    else:
        values = apply_overrides(source.config.model_dump(mode="json"), args.set)
        where = f"{source.layout.config_path} with overrides {' '.join(args.set)}"
    config = parse_config(values | {"run_id": args.new}, where)
    check_fork(source, config, args.at)  # the cheap refusals before the data and model checks
    _validate_data(config)
    _check_model(config)
    forked = fork(source, config, args.at)
    shared = ", ".join(target.label for target in forked.shared) or "nothing"
    console.print(f"run {args.new} forked from {args.run} at iteration {args.at}: shares {shared}", soft_wrap=True,
                  markup=False, highlight=False)
    return _drive(forked.run, args.debug)


def add_fork_command(commands: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]) -> None:
    fork = commands.add_parser(
        "fork", help="a new run sharing another's outputs up to an iteration where its config changes nothing"
    )
    fork.add_argument("run", help="the run to fork from")
    fork.add_argument("new", help="the new run's id")
    fork.add_argument("--at", type=int, required=True, metavar="K", help="share outputs of iterations 0..K at most")
    fork.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="override a field of the new run's config")
    fork.add_argument("--config", type=Path, help="the new run's config (default: RUN's)")
    fork.add_argument("--debug", action="store_true", help="print Prefect's traceback of a failed stage too")
    common(fork)
    fork.set_defaults(func=cmd_fork)
