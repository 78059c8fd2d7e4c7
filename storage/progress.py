"""Progress of long work: a live bar on a terminal, a line every PIPED_INTERVAL_S on a pipe or in a log file.

Stages print progress to the flow's stdout. Piped (`rlpipe run ... | tee run.log`, a Prefect worker's log) a
live bar draws nothing until the work ends, so a user watching the log of an hour-long evaluate sees nothing for
an hour; there the same figures come as a plain line now and then, and one at the end. Every bar of rlpipe
(generate, evaluate, score, train) is this one.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

PIPED_INTERVAL_S = 30.0  # how often a line is printed when stdout is not a terminal

# advance(n, stats): n more of the total done; `stats` (when given) replaces the text shown after the bar.
Advance = Callable[..., None]


@contextmanager
def progress_bar(label: str, total: int) -> Iterator[Advance]:
    """A bar over `total` units of work named `label`; yields `advance(n=1, stats=None)`."""
    console = Console()
    if console.is_terminal:
        columns = (TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[stats]}"))
        with Progress(*columns, console=console, transient=False) as bar:
            task = bar.add_task(label, total=total, stats="")

            def advance_bar(n: int = 1, stats: str | None = None) -> None:
                bar.update(task, advance=n, **({} if stats is None else {"stats": stats}))

            yield advance_bar
        return
    started = time.monotonic()
    state = {"done": 0, "stats": "", "printed": started}

    def line() -> None:
        elapsed = datetime.timedelta(seconds=int(time.monotonic() - started))
        stats = f" {state['stats']}" if state["stats"] else ""
        print(f"{label}: {state['done']}/{total} {elapsed}{stats}", flush=True)
        state["printed"] = time.monotonic()

    def advance_line(n: int = 1, stats: str | None = None) -> None:
        state["done"] += n
        if stats is not None:
            state["stats"] = stats
        if time.monotonic() - state["printed"] >= PIPED_INTERVAL_S:
            line()

    yield advance_line
    line()
