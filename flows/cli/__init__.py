"""The `rlpipe` command line: run and resume runs, inspect them, serve a team."""

from flows.cli.commands import main

__all__ = ["main"]
