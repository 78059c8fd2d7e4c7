"""The inspection commands of `rlpipe`: query, show, lineage, report, export. Read-only over the run history.

    rlpipe query "SQL" [--run RUN ...] [--out FILE.csv|FILE.parquet] [--max-rows N] [--root ROOT]
    rlpipe show RUN ITER [PROMPT [SAMPLE]] [--round R] [--root ROOT]
    rlpipe lineage RUN [ITER] [--quick] [--json] [--root ROOT]
    rlpipe report RUN [RUN ...] [--out FILE] [--root ROOT]
    rlpipe export RUN --format sft|dpo|verl|hf --out FOLDER [--where SQL] [--overwrite] [--root ROOT]

`add_inspect_commands(subparsers, common)` registers them on the main parser (flows/cli/commands.py). None of them
imports Prefect, torch or Great Expectations, so they start fast. Exit codes: 0 fine, 1 lineage found a
problem, 2 bad arguments or SQL (the message says which).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from storage.layout import RunLayout
from storage.run import resolve_root

console = Console()
err_console = Console(stderr=True)


def _root(args: argparse.Namespace) -> str:
    return resolve_root(args.root)


# --- query ---------------------------------------------------------------------------------------------------


def format_cell(value: Any, width: int = 80) -> str:
    """A result cell as short text: lists as their length, long strings cut, floats to 6 significant digits."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, list | tuple):
        return f"[{len(value)} items]"
    if isinstance(value, dict):
        value = json.dumps(value, default=str)
    text = str(value).replace("\n", "⏎")
    return text if len(text) <= width else text[: width - 1] + "…"


def run_query(root: str, sql: str, runs: list[str] | None = None, out: str | None = None,
              max_rows: int = 50) -> tuple[Any, bool]:
    """Run `sql` over the catalog: write all rows to `out` (CSV or Parquet, by extension) when given, and
    return (the first `max_rows` rows as an Arrow table, whether there are more)."""
    from storage.catalog import Catalog

    sql = sql.strip().rstrip(";")
    with Catalog(root, runs) as catalog:
        for skipped in catalog.skipped:
            err_console.print(f"[dim]not read: {skipped.path} ({skipped.reason})[/]")
        if out:
            fmt = "parquet" if out.endswith(".parquet") else "csv"
            options = "FORMAT parquet, COMPRESSION zstd" if fmt == "parquet" else "FORMAT csv, HEADER true"
            target = out.replace("'", "''")
            # COPY streams the result to the file (local, or s3:// through the registered file system).
            catalog.con.execute(f"COPY ({sql}) TO '{target}' ({options})")
        head = catalog.sql(f"SELECT * FROM ({sql}) LIMIT {int(max_rows) + 1}").to_arrow_table()
    return head.slice(0, max_rows), head.num_rows > max_rows


def query_table(head: Any, more: bool, vertical: bool | None = None) -> Table | Group:
    """A result as a table, or, when it has too many columns to read across, one block per row."""
    caption = (f"first {head.num_rows} rows shown; more rows exist (use --out to get them all)" if more
               else f"{head.num_rows} row{'s' if head.num_rows != 1 else ''}")
    if vertical is None:
        vertical = len(head.column_names) > max(console.width // 14, 6)
    if vertical:
        blocks: list[Any] = []
        for number, row in enumerate(head.to_pylist()):
            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold")
            grid.add_column(overflow="fold")
            for name, value in row.items():
                grid.add_row(name, format_cell(value, width=200))
            blocks.append(Panel(grid, title=f"row {number + 1}", title_align="left"))
        return Group(*blocks, Text(caption, style="dim"))
    table = Table(show_lines=False, caption=caption)
    for name in head.column_names:
        table.add_column(name, overflow="fold")
    for row in head.to_pylist():
        table.add_row(*[format_cell(v) for v in row.values()])
    return table


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    try:
        head, more = run_query(_root(args), args.sql, args.run or None, args.out, args.max_rows)
    except duckdb.Error as error:
        err_console.print(f"[red]query failed: {error}[/]")
        return 2
    console.print(query_table(head, more, True if args.vertical else None))
    if args.out:
        console.print(f"wrote {args.out}")
    return 0


# --- show ----------------------------------------------------------------------------------------------------


class SampleNotFound(LookupError):
    pass


def sample_story(root: str, run_id: str, iteration: int, prompt: str, sample_idx: int,
                 round_: int | None = None) -> list[dict[str, Any]]:
    """The samples-view rows (one per generation round) of one sample, with its prompt's messages and spec.

    `prompt` may be a unique prefix of the prompt id.
    """
    from storage.catalog import Catalog

    with Catalog(root, [run_id]) as catalog:
        ids = [r["prompt_id"] for r in catalog.rows(
            """SELECT DISTINCT prompt_id FROM rollouts
               WHERE run_id = $run AND iteration = $it AND starts_with(prompt_id, $prompt) ORDER BY 1""",
            {"run": run_id, "it": iteration, "prompt": prompt})]
        if not ids:
            raise SampleNotFound(f"run {run_id} iteration {iteration} has no rollouts of a prompt {prompt!r}")
        if len(ids) > 1:
            raise SampleNotFound(f"prompt {prompt!r} is ambiguous in run {run_id} iteration {iteration}: {ids}")
        rows = catalog.rows(
            """SELECT s.*, p.messages, p.reward_spec, p.dataset,
                      c.url AS generated_by_path, t.url AS trained_into_path
               FROM samples s
               LEFT JOIN (SELECT DISTINCT ON (run_id, prompt_id) * FROM prompts ORDER BY run_id, prompt_id, split)
                 p ON p.run_id = s.run_id AND p.prompt_id = s.prompt_id
               LEFT JOIN checkpoints c ON c.run_id = s.run_id AND c.checkpoint = s.generated_by
               LEFT JOIN checkpoints t ON t.run_id = s.run_id AND t.checkpoint = s.trained_into
               WHERE s.run_id = $run AND s.iter = $it AND s.iteration = $it  -- iter: Hive pruning of files
                 AND s.prompt_id = $pid AND s.sample_idx = $idx AND ($round IS NULL OR s.round = $round)
               ORDER BY s.round""",
            {"run": run_id, "it": iteration, "pid": ids[0], "idx": sample_idx, "round": round_})
    if not rows:
        raise SampleNotFound(f"run {run_id} iteration {iteration} prompt {ids[0]} has no sample {sample_idx}"
                             + (f" in round {round_}" if round_ is not None else ""))
    filter_metric = run_filter_metric(RunLayout.create(root, run_id))
    return [row | {"filter_metric": filter_metric} for row in rows]


def sample_list(root: str, run_id: str, iteration: int, prompt: str | None = None,
                round_: int | None = None) -> list[dict[str, Any]]:
    """One row per sample of an iteration (of the prompts whose id starts with `prompt`, when given): what a user
    picks a sample to `show` by. Reward and status come from its score, advantage and `kept` from the batch
    (None before those stages ran); turns and tool calls are 1 and 0 for single-turn rollouts."""
    from storage.catalog import Catalog

    with Catalog(root, [run_id]) as catalog:
        rows = catalog.rows(
            """SELECT prompt_id, sample_idx, round, reward, status, advantage, kept, num_tokens, finish_reason,
                      num_turns, tool_calls
               FROM samples
               WHERE run_id = $run AND iter = $it AND iteration = $it  -- iter: Hive pruning of files
                 AND starts_with(prompt_id, $prompt) AND ($round IS NULL OR round = $round)
               ORDER BY prompt_id, round, sample_idx""",
            {"run": run_id, "it": iteration, "prompt": prompt or "", "round": round_})
    if not rows:
        of = f" of a prompt {prompt!r}" if prompt else ""
        raise SampleNotFound(f"run {run_id} iteration {iteration} has no rollouts{of}"
                             + (f" in round {round_}" if round_ is not None else ""))
    return rows


def shortest_unique_prefixes(ids: list[str], least: int = 6) -> dict[str, str]:
    """Each id's shortest prefix of at least `least` characters that no other id of `ids` starts with."""
    unique = sorted(set(ids))
    prefixes = {}
    for position, full in enumerate(unique):
        neighbours = unique[max(position - 1, 0):position] + unique[position + 1:position + 2]
        common = max((len(os.path.commonprefix([full, other])) for other in neighbours), default=0)
        prefixes[full] = full[:max(least, common + 1)]
    return prefixes


def render_sample_list(run_id: str, iteration: int, rows: list[dict[str, Any]]) -> Group:
    """The samples of `sample_list` as a table, with the command that shows one of them."""
    prefixes = shortest_unique_prefixes([row["prompt_id"] for row in rows])
    multi_turn = any(row["num_turns"] and row["num_turns"] > 1 or row["tool_calls"] for row in rows)
    rounds = any(row["round"] for row in rows)
    prompts = f"{len(prefixes)} prompt" + ("s" if len(prefixes) > 1 else "")
    table = Table(title=f"run {run_id} iteration {iteration}: {len(rows)} samples of {prompts}",
                  box=box.SIMPLE_HEAD)
    columns = ["prompt", "sample", *(["round"] if rounds else []), "reward", "status", "advantage", "tokens", "finish",
               *(["turns", "tool calls"] if multi_turn else [])]
    for column in columns:
        table.add_column(column, justify="left" if column in ("prompt", "status", "finish") else "right")
    for row in rows:
        advantage = ("-" if row["kept"] is None else "dropped" if not row["kept"] else f"{row['advantage']:+.3f}")
        table.add_row(prefixes[row["prompt_id"]], str(row["sample_idx"]), *([str(row["round"])] if rounds else []),
                      "-" if row["reward"] is None else f"{row['reward']:.3f}", row["status"] or "-", advantage,
                      str(row["num_tokens"]), row["finish_reason"],
                      *([str(row["num_turns"]), str(row["tool_calls"])] if multi_turn else []))
    first = rows[0]
    hint = Text(f"one sample's story: rlpipe show {run_id} {iteration} {prefixes[first['prompt_id']]} "
                f"{first['sample_idx']}", style="dim")
    return Group(table, hint)


def run_filter_metric(layout: RunLayout) -> str | None:
    """What the run's group filters judged (advantage.filter_metric), or None when its config does not parse."""
    from schemas.config import ConfigError
    from storage.run import read_run_config

    try:
        return read_run_config(layout).advantage.filter_metric
    except ConfigError:
        return None


# advantage.filter_metric's values, as `show` names them beside a dropped group
FILTER_METRICS = {"acc": "correctness (acc: 1 when every test passed)", "seq_reward": "scored reward (seq_reward)",
                  "reward": "shaped reward (reward)"}


def drop_explanation(reason: str | None, filter_metric: str | None) -> str:
    """Why a sample's group was left out of the loss, naming what the filter judged: the display's group std is
    the shaped reward's, which can vary where correctness (the default filter metric) did not."""
    judged = FILTER_METRICS.get(filter_metric or "", "advantage.filter_metric")
    if reason == "zero_variance":
        return f"dropped, zero_variance: every sample of the group had the same {judged}"
    if reason == "success_rate_out_of_range":
        return (f"dropped, success_rate_out_of_range: the group's mean {judged} is outside "
                "advantage.min_group_mean..max_group_mean")
    return f"dropped, {reason}"


def _messages(text: str | None) -> Text:
    out = Text()
    try:
        items = json.loads(text or "[]")
    except json.JSONDecodeError:
        return Text(text or "")
    for message in items:
        out.append(f"{message.get('role', '?')}: ", style="bold cyan")
        out.append(f"{message.get('content', '')}\n")
    return out


def _tests_table(tests: str | None) -> Table | Text:
    try:
        items = json.loads(tests or "[]")
    except json.JSONDecodeError:
        return Text(tests or "")
    if not items:
        return Text("no tests were run (no code was found, or the spec has none)", style="dim")
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for column in ("", "test", "status", "message"):
        table.add_column(column, overflow="fold")
    for test in items:
        mark = "[green]✓[/]" if test.get("passed") else "[red]✗[/]"
        table.add_row(mark, str(test.get("name", "")), str(test.get("status", "")), str(test.get("message") or ""))
    return table


def _conversation_panel(row: dict[str, Any]) -> Panel:
    """A multi-turn rollout turn by turn: each message's role, the model turns' tokens and (feedback mode)
    reward, the tool calls' count, errors and time in the title; the score grades the last assistant turn."""
    try:
        messages = json.loads(row.get("conversation") or "[]")
    except json.JSONDecodeError:
        return Panel(Text(row.get("conversation") or ""), title="conversation", title_align="left")
    spans = row.get("turn_spans") or []
    rewards = row.get("turn_rewards") or []
    out = Text()
    turn = 0
    for message in messages:
        role = message.get("role", "?")
        if role == "assistant":
            notes = [f"{spans[turn][1] - spans[turn][0]} tokens"] if turn < len(spans) else []
            if turn < len(rewards):
                notes.append(f"reward {format_cell(rewards[turn])}")
            out.append(f"assistant, turn {turn + 1}", style="bold cyan")
            out.append(f" ({', '.join(notes)})" if notes else "", style="dim")
            turn += 1
        else:
            out.append("tool output" if role == "tool" else f"{role} (feedback)", style="bold magenta")
        out.append(f":\n{message.get('content', '')}\n\n")
    title = (f"conversation · {row.get('num_turns')} turns · {row.get('tool_calls')} tool calls, "
             f"{row.get('tool_errors')} errors, {format_cell(row.get('tool_seconds'))} s in the tool")
    return Panel(out, title=title, title_align="left")


def render_story(row: dict[str, Any]) -> Group:
    """Everything about one sample, top to bottom: where it came from, what it said, how it scored."""
    sha = (row.get("policy_version") or "")[:12]
    generated = f"{row.get('generated_by') or 'unknown checkpoint'} (sha {sha})"
    if row.get("trained_into"):
        dropped = drop_explanation(row.get("drop_reason"), row.get("filter_metric"))
        used = "in the loss (kept)" if row.get("kept") else f"[yellow]not in the loss: {escape(dropped)}[/]"
        trained = f"{row['trained_into']} (sha {(row.get('trained_into_sha256') or '')[:12]}), {used}"
    else:
        trained = "[dim]not trained on yet (no checkpoint of this iteration names this batch as its input)[/]"
    spec = {}
    try:
        spec = json.loads(row.get("reward_spec") or "{}")
    except json.JSONDecodeError:
        pass
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("sample", f"run {row['run_id']} · iteration {row['iteration']} · round {row['round']} · "
                             f"prompt {row['prompt_id']} · sample {row['sample_idx']}")
    header.add_row("prompt", f"{row.get('dataset') or '?'} · reward kind {spec.get('kind', '?')}")
    header.add_row("generated by", generated)
    header.add_row("trained into", trained)
    header.add_row("generation", f"{row.get('num_tokens')} tokens · finish {row.get('finish_reason')} · "
                                 f"seed {row.get('seed')} · backend {row.get('backend')}")
    reward = row.get("reward")
    reward_style = "green" if reward is not None and reward >= 1 else ("red" if not reward else "yellow")
    score = Table.grid(padding=(0, 2))
    score.add_column(style="bold")
    score.add_column()
    sandbox = format_cell(row.get("sandbox_seconds"))
    score.add_row("reward", f"[{reward_style}]{format_cell(reward)}[/] · {row.get('passed')}/{row.get('total')} "
                            f"tests passed · status {row.get('status')} · sandbox {sandbox} s")
    if row.get("advantage") is not None:
        score.add_row("advantage", f"{format_cell(row.get('advantage'))} (shaped reward "
                                   f"{format_cell(row.get('shaped_reward'))}; group of {row.get('group_size')}, its "
                                   f"shaped rewards' mean {format_cell(row.get('group_mean'))}, std "
                                   f"{format_cell(row.get('group_std'))})")
    else:
        score.add_row("advantage", "[dim]no batch row yet (advantage stage not run)[/]")
    code = row.get("code")
    parts = [
        header,
        Panel(_messages(row.get("messages")), title="prompt", title_align="left"),
        (Panel(Text(row.get("response_text") or ""), title="response", title_align="left")
         if row.get("conversation") is None else _conversation_panel(row)),
        Panel(Syntax(code, "python", word_wrap=True) if code else Text("no code extracted", style="dim"),
              title="extracted code", title_align="left"),
        Panel(_tests_table(row.get("tests")), title="tests", title_align="left"),
        score,
    ]
    return Group(*parts)


def cmd_show(args: argparse.Namespace) -> int:
    try:
        if args.sample is None:  # which samples there are, to pick one
            listed = sample_list(_root(args), args.run, args.iter, args.prompt, args.round)
            listing = render_sample_list(args.run, args.iter, listed)
            # never squeezed into "...": wider than the terminal (a pipe counts as 80 columns) rather than cut
            needed = console.measure(listing.renderables[0], options=console.options.update(max_width=1000)).maximum
            Console(width=max(console.width, needed)).print(listing)
            return 0
        rows = sample_story(_root(args), args.run, args.iter, args.prompt, args.sample, args.round)
    except SampleNotFound as error:
        err_console.print(f"[red]{error}[/]")
        return 2
    for row in rows:
        console.print(render_story(row))
    return 0


# --- lineage -------------------------------------------------------------------------------------------------


def latest_iteration(root: str, run_id: str) -> int:
    from storage.catalog import list_outputs

    listing = list_outputs(root, [run_id])
    iterations = [e.iteration for e in listing.checkpoints if e.iteration is not None and e.iteration >= 0]
    iterations = iterations or [e.iteration for e in listing.all_entries() if e.iteration is not None]
    if not iterations:
        raise FileNotFoundError(f"run {run_id} has no outputs under {root}")
    return max(iterations)


def lineage_lines(result: Any) -> list[Text]:
    """One line per output, oldest first: check mark, output, what it is, hash, what it was made from."""
    from storage.lineage import describe

    marks = {"ok": ("✓", "green"), "missing": ("✗", "red"), "modified": ("✗", "red"), "unverified": ("?", "yellow"),
             "pruned": ("-", "dim")}
    data = ", ".join(f"{k}={v}" for k, v in result.data.items() if k in ("train", "test"))
    title = f"lineage of run {result.run_id}, iteration {result.iteration}" + (f" (data: {data})" if data else "")
    lines = [Text(title, style="bold")]
    for node in result.nodes:
        mark, style = marks.get(node.check, ("·", "dim"))
        line = Text(f"  {mark} ", style=style)
        line.append(f"{node.label:<24}", style="bold")
        line.append(f" {node.manifest.sha256[:12]}  ", style="dim")
        line.append(describe(node))
        if node.manifest.shared_from:  # a fork's output, computed by another run (storage/sharing.py)
            line.append(f"  shared from run {node.manifest.shared_from['run']}", style="magenta")
        if node.inputs:
            made_from = ", ".join(label or f"{name}: unresolved" for name, label in sorted(node.inputs.items()))
            line.append(f"  ← {made_from}", style="cyan" if all(node.inputs.values()) else "red")
        if node.check not in ("ok", "not checked"):
            line.append(f"  [{node.check}]", style=style)
        lines.append(line)
    return lines


def cmd_lineage(args: argparse.Namespace) -> int:
    from storage.lineage import lineage, to_json

    root = _root(args)
    try:
        iteration = args.iter if args.iter is not None else latest_iteration(root, args.run)
        result = lineage(root, args.run, iteration, mode="size" if args.quick else "hash")
    except FileNotFoundError as error:
        err_console.print(f"[red]{error}[/]")
        return 2
    if args.json:
        print(to_json(result))
        return 0 if result.ok else 1
    for line in lineage_lines(result):
        console.print(line, soft_wrap=True)
    for warning in result.warnings:
        console.print(f"[yellow]! {warning}[/]")
    for problem in result.problems:
        console.print(f"[red]✗ {problem}[/]")
    hashed = sum(n.hashed_bytes for n in result.nodes)
    if result.ok:
        how = "sizes checked" if args.quick else f"{hashed / 1e6:.1f} MB hashed"
        console.print(f"[green]✓ every file of the chain matches its manifest ({len(result.nodes)} outputs, {how})[/]")
        return 0
    console.print(f"[red]{len(result.problems)} problem(s) in the lineage of {args.run} iteration {iteration}[/]")
    return 1


# --- report --------------------------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """One run: its report (runs/<run>/report.html). Several: their curves overlaid on one page."""
    from reports.compare import UnknownRun, build_comparison, require_runs, write_comparison
    from reports.html import build_report, read_config, write_report

    root = _root(args)
    if len(set(args.runs)) < len(args.runs):
        err_console.print(f"[red]a run is named twice: {' '.join(args.runs)}[/]")
        return 2
    single = len(args.runs) == 1
    try:
        layout = require_runs(root, args.runs)[0]  # every run named exists, else one line and nothing written
        if args.out:
            text = build_report(layout, read_config(layout)) if single else build_comparison(root, args.runs)
            with open(args.out, "w", encoding="utf-8") as handle:
                handle.write(text)
            path = args.out
        else:
            path = write_report(layout, read_config(layout)) if single else write_comparison(root, args.runs)
    except UnknownRun as error:
        err_console.print(str(error), style="red", soft_wrap=True, markup=False, highlight=False)
        return 2
    console.print(f"wrote {path}")
    return 0


# --- export --------------------------------------------------------------------------------------------------


def cmd_export(args: argparse.Namespace) -> int:
    """A run's rollouts as a dataset folder (stages/data/export.py); a bad run, query or path is one line, exit 2."""
    from schemas.errors import InputError
    from stages.data.export import export_run

    try:
        done = export_run(_root(args), args.run, args.format, args.out, args.where, args.overwrite)
    except InputError as error:
        err_console.print(str(error), style="red", soft_wrap=True, markup=False, highlight=False)
        return 2
    console.print(f"wrote {done.rows} {args.format} rows ({done.manifest['selected_rollouts']} rollouts of "
                  f"iterations {done.manifest['iterations']}) to {done.out}", soft_wrap=True, markup=False)
    return 0


# --- registration --------------------------------------------------------------------------------------------


def add_inspect_commands(
    commands: argparse._SubParsersAction, common: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Register query, show, lineage, report and export on `rlpipe`'s subcommands (`common` adds --root)."""
    query = commands.add_parser("query", help="SQL over every run's tables (DuckDB)")
    query.add_argument("sql", help="e.g. \"SELECT iteration, avg(reward) FROM scores GROUP BY 1 ORDER BY 1\"")
    query.add_argument("--run", action="append", default=[], help="only these runs (repeatable; default all)")
    query.add_argument("--out", help="write all rows to this .csv or .parquet file")
    query.add_argument("--max-rows", type=int, default=50, help="rows to print (default 50)")
    query.add_argument("--vertical", action="store_true", help="one block per row (automatic for wide results)")
    common(query)
    query.set_defaults(func=cmd_query)

    show = commands.add_parser("show", help="one sample's full story (without a sample: the iteration's samples)")
    show.add_argument("run")
    show.add_argument("iter", type=int)
    show.add_argument("prompt", nargs="?", help="prompt id (a unique prefix is enough); without it, every prompt's "
                                                "samples are listed")
    show.add_argument("sample", type=int, nargs="?", help="sample index; without it, the prompt's samples are listed")
    show.add_argument("--round", type=int, help="generation round (default: all)")
    common(show)
    show.set_defaults(func=cmd_show)

    lineage = commands.add_parser("lineage", help="the chain from base model and data to a checkpoint, verified")
    lineage.add_argument("run")
    lineage.add_argument("iter", type=int, nargs="?", help="iteration (default: the latest with a checkpoint)")
    lineage.add_argument("--quick", action="store_true", help="compare sizes instead of hashing contents")
    lineage.add_argument("--json", action="store_true", help="print the lineage as JSON")
    common(lineage)
    lineage.set_defaults(func=cmd_lineage)

    report = commands.add_parser(
        "report", help="write a run's HTML report (runs/<run>/report.html), or compare runs on one page "
        "(<root>/reports/compare-A-vs-B.html)")
    report.add_argument("runs", nargs="+", metavar="RUN", help="one run, or several to overlay")
    report.add_argument("--out", help="write here instead of into the run directory (or <root>/reports/)")
    common(report)
    report.set_defaults(func=cmd_report)

    # stages.data.export (DuckDB, pyarrow) is imported when the command runs, so every other command starts fast.
    export = commands.add_parser("export", help="a run's rollouts as a dataset: TRL SFT or DPO, verl, `datasets`")
    export.add_argument("run")
    export.add_argument("--format", required=True, help="sft, dpo, verl or hf (docs/usage.md)")
    export.add_argument("--out", required=True, help="the folder to write (refused if it exists)")
    export.add_argument("--where", help="SQL condition on the rows (docs/usage.md lists the columns); default: "
                        "passing responses (status = 'ok') for sft, every row otherwise")
    export.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    common(export)
    export.set_defaults(func=cmd_export)


def main(argv: list[str] | None = None) -> int:
    """Run only the inspection commands (what `rlpipe` does once flows/cli/commands.py registers them)."""
    parser = argparse.ArgumentParser(prog="rlpipe")
    commands = parser.add_subparsers(dest="command", required=True)
    add_inspect_commands(commands, lambda p: p.add_argument("--root"))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
