"""score.rewards: a response's reward as the weighted sum of built-in verifiers, a format reward and user functions.

Entries are `{fn, weight}`: `code_tests`, `code_stdio`, `code_call`, `math` (the sandbox verifier of rows of
that kind, skipped for others), `think_format` (1 for `<think>...</think><answer>...</answer>`), or a user
function `package.module:function` / `path/to/file.py:function` with verl's `compute_score(data_source,
solution_str, ground_truth, extra_info)` or TRL's `reward_func(prompts, completions, **columns)` signature, told
apart by parameter names. Empty: each row's verifier of its kind, weight 1 (the default before this existed).

User functions run in another process (reward_host.py), one row per call, so one that raises, runs past
score.timeout_s (the process is then replaced), returns a non-finite value or not a number marks only that row
`error`; each such message ends with the user's file:line. Model code reaches the sandbox through
`stages.sandbox.run_code`, never an exec here. A row's reward is the sum of weight x value over the terms that
apply (a TRL None does not); a `no_code` row keeps exactly score.no_code_penalty; status, passed/total and tests
are the verifier's plus one test entry per other term, and a row without a verifier (kind `custom`) is `ok` when
its reward is > 0. Each result also lists its terms by short name (`reward_names`); a stage's `account_for`
prints each term's mean and failed share (`summarize`), stops the stage when a function failed too often
(`check_failures`, score.max_reward_error_fraction: a broken reward is an error, not a silent 0), and gives
the manifest's `reward_functions`. `score_with_progress` is what the score and evaluate stages call: `score` in
a sandbox pool of its own, with a progress bar.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from schemas.config import BUILTIN_REWARDS, VERIFIER_REWARDS, RewardEntry, ScoreConfig, data_source_of
from schemas.errors import InputError

from ._runner import HEADER
from .jobs import ScoreJob, ScoreResult
from .judge import JobTimeout
from .process import read_exact, write_all

PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
# Beyond score.timeout_s for a user function: the host's own start (interpreter + the user's imports).
START_TIMEOUT_S = 60.0


class RewardSetupError(ValueError):
    """A reward entry that cannot be used (import error, no known signature, a kind nothing scores)."""


@dataclass(frozen=True)
class RewardInput:
    """What a reward function may read beyond the response: the prompt's messages, metadata and dataset."""

    messages: list[dict[str, str]]
    metadata: dict[str, Any]
    dataset: str

    @classmethod
    def of_prompt(cls, prompt: dict[str, Any]) -> RewardInput:
        """From a row of the prompts table (JSON text columns)."""
        return cls(json.loads(prompt["messages"]), json.loads(prompt["metadata"]), prompt["dataset"])


# ---------------------------------------------------------------------------------------------------------
# Loading user functions (here for the checks at `rlpipe run`, and in reward_host.py for the calls)


def load_function(fn: str) -> Callable[..., Any]:
    """Import `package.module:function` or `path/to/file.py:function` (relative to the working directory)."""
    target, _, name = fn.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise RewardSetupError(f"{path} does not exist")
        spec = importlib.util.spec_from_file_location(f"rlpipe_reward_{abs(hash(str(path)))}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:  # as `python -m` would: modules beside the working directory import
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(target)
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardSetupError(f"{target} has no function {name!r}")
    return function


def signature_style(function: Callable[..., Any]) -> str:
    """"verl" for compute_score(data_source, solution_str, ground_truth, extra_info), "trl" for
    reward_func(prompts, completions, **kwargs); told apart by parameter names."""
    parameters = inspect.signature(function).parameters
    names = set(parameters)
    if "solution_str" in names:
        return "verl"
    if "completions" in names:
        return "trl"
    raise RewardSetupError(
        f"parameters ({', '.join(parameters)}) match neither verl's compute_score(data_source, solution_str, "
        "ground_truth, extra_info) nor TRL's reward_func(prompts, completions, **kwargs)"
    )


def user_entries(cfg: ScoreConfig) -> list[tuple[int, RewardEntry]]:
    return [(index, entry) for index, entry in enumerate(cfg.rewards) if entry.fn not in BUILTIN_REWARDS]


def reward_names(entries: list[RewardEntry]) -> list[str]:
    """Each entry's short name in metrics and trackers: a built-in's own, a user function's name; user functions
    that share a name (verl's are all `compute_score`) get their file's stem or module's last part before it
    (`concise.compute_score`), and what still collides its index in score.rewards (`compute_score_2`)."""
    plain = [entry.fn if entry.fn in BUILTIN_REWARDS else entry.fn.rpartition(":")[2] for entry in entries]
    names = [name if entry.fn in BUILTIN_REWARDS or plain.count(name) == 1 else _qualified(entry.fn)
             for entry, name in zip(entries, plain, strict=True)]
    return [f"{name}_{index}" if names.count(name) > 1 else name for index, name in enumerate(names)]


def _qualified(fn: str) -> str:
    """`path/concise.py:compute_score` -> `concise.compute_score`; `pkg.grading:score` -> `grading.score`."""
    target, _, name = fn.rpartition(":")
    owner = Path(target).stem if target.endswith(".py") else target.rpartition(".")[2]
    return f"{owner}.{name}"


def entry_label(index: int, entry: RewardEntry) -> str:
    return f"score.rewards[{index}] {entry.fn!r}"


def check_rewards(cfg: ScoreConfig, kinds: set[str]) -> None:
    """Every user function imports and has a known signature, and every reward kind in `kinds` (the
    prompts') is scored by something; a RewardSetupError naming the entry or the kind otherwise."""
    for index, entry in user_entries(cfg):
        try:
            signature_style(load_function(entry.fn))
        except Exception as error:  # import errors of any type, raised by the user's module
            message = str(error) if isinstance(error, RewardSetupError) else f"{type(error).__name__}: {error}"
            raise RewardSetupError(f"{entry_label(index, entry)}: {message}") from None
    verifiers = set(VERIFIER_REWARDS) if not cfg.rewards else {e.fn for e in cfg.rewards if e.fn in VERIFIER_REWARDS}
    if user_entries(cfg):
        return  # a user function scores every row
    unscored = sorted(kinds - verifiers)
    if unscored:
        hint = ("name a reward function for them in score.rewards" if "custom" in unscored
                else f"add {', '.join(k for k in unscored)} to score.rewards")
        raise RewardSetupError(f"prompts of kind {', '.join(unscored)} have no reward: {hint}")


# ---------------------------------------------------------------------------------------------------------
# The inputs each signature receives


def ground_truth_of(spec: dict[str, Any], metadata: dict[str, Any]) -> Any:  # noqa: ANN401 - verl's is any
    """verl's `ground_truth`: the source's own where it had one (verl rows), else the spec's in verl's
    spelling (a math answer; code cases as JSON text; HumanEval test code)."""
    if "ground_truth" in metadata:
        return metadata["ground_truth"]
    kind = spec.get("kind")
    if kind == "math":
        return spec.get("answer")
    if kind in ("code_stdio", "code_call"):
        return json.dumps({key: spec[key] for key in ("fn_name", "inputs", "outputs") if key in spec})
    if kind == "code_tests":
        return spec.get("test")
    return (spec.get("columns") or {}).get("ground_truth")


def call_arguments(style: str, job: ScoreJob, row: RewardInput) -> dict[str, Any]:
    if style == "verl":
        return {
            "data_source": data_source_of(row.metadata, row.dataset),
            "solution_str": job.response_text,
            "ground_truth": ground_truth_of(job.reward_spec, row.metadata),
            "extra_info": row.metadata.get("extra_info", row.metadata),
        }
    # TRL: a batch of one; conversational prompts and completions, every metadata column as a list.
    columns = {key: [value] for key, value in row.metadata.items() if key not in ("prompts", "completions")}
    completion = [{"role": "assistant", "content": job.response_text}]
    return {"prompts": [row.messages], "completions": [completion], **columns}


def think_format(text: str) -> float:
    """1.0 when the response is <think>...</think> then <answer>...</answer> (and nothing else), else 0.0."""
    return 1.0 if _THINK_ANSWER.fullmatch(text) else 0.0


# ---------------------------------------------------------------------------------------------------------
# The host process


@dataclass
class Call:
    """One user function's answer for one row: a value (None: does not apply) or an error."""

    value: float | None = None
    error: str = ""
    seconds: float = 0.0
    text: str = ""  # a tool's answer (a host started with tools)


class RewardHost:
    """The process that runs user reward functions (reward_host.py), restarted after a timeout.

    `run_code` requests from the functions are answered with `run_code(request)` (the stage's sandbox);
    time spent there does not count against the function's timeout (each run has its own). With `tools`
    (ToolEntry dicts, generate.multi_turn.tools) it serves tool calls instead: `Call.text` is the answer."""

    def __init__(self, entries: list[str], timeout_s: float, run_code: Callable[[dict], dict] | None,
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.entries = entries
        self.tools = tools
        self.timeout_field = "score.timeout_s" if tools is None else "generate.multi_turn.tool_timeout_s"
        self.timeout_s = timeout_s
        self.run_code = run_code
        self.process: subprocess.Popen[bytes] | None = None
        self.styles: list[str] = []
        self.locations: list[str] = []  # each function's file:line, for the messages written here

    def __enter__(self) -> RewardHost:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, PYTHONPATH=PROJECT_ROOT + (os.pathsep + path if path else ""))
        self.process = subprocess.Popen(
            # `-c`, not `-m`: the package imports reward_host too, and `-m` would make a second copy of it, whose
            # run_code would not know the stage. `-c` also puts the working directory first on sys.path.
            [sys.executable, "-c", "import sys; from stages.sandbox.reward_host import main; sys.exit(main())"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, cwd=os.getcwd(), start_new_session=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        for stream in (self.process.stdin, self.process.stdout):
            os.set_blocking(stream.fileno(), False)
        self._send({"entries": self.entries} if self.tools is None else {"tools": self.tools})
        try:
            reply = self._receive(time.monotonic() + START_TIMEOUT_S)
        except JobTimeout:
            reply = None
        if reply is None or "fatal" in reply:
            self.stop()
            raise RewardSetupError((reply or {}).get("fatal") or "the reward function process did not start")
        self.styles = reply["styles"]
        self.locations = reply["locations"]

    def stop(self) -> None:
        if self.process is None:
            return
        process, self.process = self.process, None
        try:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: whatever the functions started goes too
        except ProcessLookupError:
            pass
        process.wait()
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()

    def _send(self, message: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        payload = json.dumps(message).encode()
        if not write_all(self.process.stdin.fileno(), HEADER.pack(len(payload)) + payload, time.monotonic() + 30):
            raise JobTimeout("the reward function process stopped reading")

    def _receive(self, deadline: float) -> dict[str, Any] | None:
        """The next message; None when the process ended; JobTimeout at the deadline."""
        assert self.process is not None and self.process.stdout is not None
        fd = self.process.stdout.fileno()
        header = read_exact(fd, HEADER.size, deadline)
        if header is None:
            return None
        (length,) = HEADER.unpack(header)
        body = read_exact(fd, length, deadline)
        return json.loads(body) if body is not None else None

    def call(self, index: int, arguments: dict[str, Any]) -> Call:
        """Call entry `index` with `arguments`; never raises for the function's faults."""
        if self.process is None:
            self.start()
        started = time.monotonic()
        deadline = started + self.timeout_s
        try:
            self._send({"call": index, "arguments": arguments})
            while True:
                reply = self._receive(deadline)
                if reply is None:
                    self.stop()
                    owner = "tool" if self.tools is not None else "reward function"
                    return Call(error=f"the {owner}'s process exited ({self.locations[index]})",
                                seconds=time.monotonic() - started)
                if "run_code" not in reply:
                    break
                paused = time.monotonic()
                answer = self.run_code(reply["run_code"]) if self.run_code else _no_sandbox()
                deadline += time.monotonic() - paused
                self._send({"run_code_reply": answer})
        except JobTimeout:
            self.stop()  # the next call starts a fresh process
            return Call(error=f"no result within {self.timeout_field} = {self.timeout_s:g} s ({self.locations[index]})",
                        seconds=self.timeout_s)
        seconds = time.monotonic() - started
        if "error" in reply:
            return Call(error=reply["error"], seconds=seconds)
        # value: finite or None (reward_host.reward_value); text: a tool's answer
        return Call(value=reply.get("value"), seconds=seconds, text=reply.get("text", ""))


def _no_sandbox() -> dict[str, Any]:
    return {"status": "SandboxError", "message": "no sandbox in this process", "run_result": None, "files": {}}


# ---------------------------------------------------------------------------------------------------------
# Scoring with the configured entries


@dataclass
class Term:
    fn: str  # the score.rewards entry, as the row's test entry names it
    name: str  # its short name (reward_names)
    weight: float
    value: float | None  # None: does not apply to the row
    error: str = ""
    seconds: float = 0.0

    def as_test(self) -> dict[str, Any]:
        if self.error:
            return {"name": f"reward {self.fn}", "passed": False, "status": "error", "message": self.error[:500]}
        passed = self.value is not None and self.value > 0
        return {"name": f"reward {self.fn}", "passed": passed, "status": "ok",
                "message": f"{self.value:g} x weight {self.weight:g}"}

    def record(self) -> dict[str, Any]:
        """The term in ScoreResult.terms."""
        return {"name": self.name, "value": None if self.error else self.value, "error": self.error}


@dataclass
class RewardPlan:
    """The configured entries, split into verifiers (by kind), format rewards and user functions."""

    verifiers: dict[str, float] = field(default_factory=dict)
    formats: list[RewardEntry] = field(default_factory=list)
    users: list[RewardEntry] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)  # entry fn -> its short name

    @classmethod
    def from_config(cls, cfg: ScoreConfig) -> RewardPlan:
        plan = cls(names=dict(zip([entry.fn for entry in cfg.rewards], reward_names(cfg.rewards), strict=True)))
        for entry in cfg.rewards:
            if entry.fn in VERIFIER_REWARDS:
                plan.verifiers[entry.fn] = entry.weight
            elif entry.fn in BUILTIN_REWARDS:
                plan.formats.append(entry)
            else:
                plan.users.append(entry)
        return plan


def progress_total(cfg: ScoreConfig, jobs: list[ScoreJob]) -> int:
    """Steps `score` reports: one per verifier job, plus one per row when user functions run."""
    if not cfg.rewards:
        return len(jobs)
    plan = RewardPlan.from_config(cfg)
    verified = sum((job.reward_spec or {}).get("kind") in plan.verifiers for job in jobs)
    return verified + (len(jobs) if plan.users else 0)


def score(
    sandbox: Any,  # noqa: ANN401 - Sandbox or FusionSandbox: score(jobs, progress) and run_code(request)
    cfg: ScoreConfig,
    jobs: list[ScoreJob],
    rows: list[RewardInput],
    progress: Callable[[int], None] | None = None,
) -> list[ScoreResult]:
    """The reward of every job under score.rewards (the sandbox's verdicts alone when it is empty)."""
    if not cfg.rewards:
        results = sandbox.score(jobs, progress=progress)
        for job, result in zip(jobs, results, strict=True):  # the one term: the verifier of the row's kind
            result.terms = [{"name": str((job.reward_spec or {}).get("kind")), "value": result.reward, "error": ""}]
        return results
    plan = RewardPlan.from_config(cfg)
    indices = [i for i, job in enumerate(jobs) if (job.reward_spec or {}).get("kind") in plan.verifiers]
    verified = dict(zip(indices, sandbox.score([jobs[i] for i in indices], progress=progress), strict=True))
    user_terms: dict[int, list[Term]] = {}
    if plan.users:
        with RewardHost([entry.fn for entry in plan.users], cfg.timeout_s, sandbox.run_code) as host:
            for i, (job, row) in enumerate(zip(jobs, rows, strict=True)):
                if i not in verified or verified[i].status != "no_code":
                    user_terms[i] = [_user_term(host, k, entry, plan.names[entry.fn], job, row)
                                     for k, entry in enumerate(plan.users)]
                if progress is not None:
                    progress(1)
    return [
        combine(cfg, plan, job, verified.get(i), user_terms.get(i, [])) for i, job in enumerate(jobs)
    ]


def score_with_progress(
    cfg: ScoreConfig, jobs: list[ScoreJob], label: str, rows: list[RewardInput]
) -> list[ScoreResult]:
    """`score` in a sandbox pool of its own, with a progress bar: what the score and evaluate stages run (`rows`:
    what reward functions read beyond each job's response). A reward entry that cannot be used is bad input."""
    # Imported here: the reward host (reward_host.py) imports this module and needs neither.
    from storage.progress import progress_bar

    from .sandbox import Sandbox

    with Sandbox.from_config(cfg) as sandbox, progress_bar(label, progress_total(cfg, jobs)) as advance:
        try:
            return score(sandbox, cfg, jobs, rows, progress=advance)
        except RewardSetupError as error:
            raise InputError(str(error)) from None


def _user_term(
    host: RewardHost, index: int, entry: RewardEntry, name: str, job: ScoreJob, row: RewardInput
) -> Term:
    if not host.styles:
        host.start()
    call = host.call(index, call_arguments(host.styles[index], job, row))
    return Term(entry.fn, name, entry.weight, call.value, call.error, call.seconds)


def combine(
    cfg: ScoreConfig, plan: RewardPlan, job: ScoreJob, verified: ScoreResult | None, user_terms: list[Term]
) -> ScoreResult:
    kind = (job.reward_spec or {}).get("kind")
    verifier = [] if verified is None else [Term(kind, plan.names[kind], plan.verifiers[kind], verified.reward)]
    if verified is not None and verified.status == "no_code":
        # nothing to grade: exactly the penalty, whatever else is configured
        return replace(verified, terms=[term.record() for term in verifier])
    terms = [Term(entry.fn, plan.names[entry.fn], entry.weight, think_format(job.response_text))
             for entry in plan.formats] + user_terms
    applied = [term for term in terms if term.error or term.value is not None]
    reward = sum(term.weight * term.value for term in applied if term.value is not None and not term.error)
    tests = [term.as_test() for term in applied]
    if verified is not None:
        reward += plan.verifiers[kind] * verified.reward
        passed, total, status = verified.passed, verified.total, verified.status
        tests = verified.tests + tests
    else:
        passed, total = sum(test["passed"] for test in tests), len(tests)
        status = "ok" if reward > 0 else "fail"
    if any(term.error for term in applied):
        status = "error"
    seconds = (verified.seconds if verified else 0.0) + sum(term.seconds for term in terms)
    code = verified.code if verified else None
    records = [term.record() for term in verifier + terms]
    return ScoreResult(float(reward), passed, total, status, tests, code, seconds, records)


# ---------------------------------------------------------------------------------------------------------
# Each term over a stage's rows


@dataclass
class RewardSummary:
    """One score.rewards term over a stage's rows: the calls it answered, those that failed (raised, timed out,
    returned NaN or not a number) with the first message, and the mean of its values (a TRL None is a call
    without a value; a verifier's `no_code` rows count at score.no_code_penalty)."""

    name: str
    fn: str
    weight: float
    calls: int = 0
    errors: int = 0
    value_sum: float = 0.0
    values: int = 0
    first_error: str = ""

    @property
    def mean(self) -> float | None:
        return self.value_sum / self.values if self.values else None

    @property
    def error_frac(self) -> float:
        return self.errors / self.calls if self.calls else 0.0

    def add(self, term: dict[str, Any]) -> None:
        self.calls += 1
        if term["error"]:
            self.errors += 1
            self.first_error = self.first_error or " ".join(term["error"].split())[:300]  # one line
        elif term["value"] is not None:
            self.value_sum += term["value"]
            self.values += 1

    def metrics(self) -> dict[str, Any]:
        """The term in the stage manifest's `rewards` metrics."""
        return {"fn": self.fn, "weight": self.weight, "calls": self.calls, "errors": self.errors,
                "error_frac": self.error_frac, "values": self.values, "mean": self.mean,
                "first_error": self.first_error}

    def line(self) -> str:
        """One line of the stage's output."""
        if not self.calls:
            return f"reward {self.name}: no row of its kind"
        mean = "no value" if self.mean is None else f"mean {self.mean:.3f}"
        failed = (f"{self.errors} failed ({self.error_frac:.0%}), first: {self.first_error}" if self.errors
                  else "none failed")
        return f"reward {self.name}: {mean} over {self.calls} calls, {failed}"


def summarize(cfg: ScoreConfig, results: list[ScoreResult]) -> list[RewardSummary]:
    """Every score.rewards entry over `results`, in config order (with the default, empty score.rewards: each
    verifier kind present, by name)."""
    if cfg.rewards:
        summaries = {name: RewardSummary(name, entry.fn, entry.weight)
                     for name, entry in zip(reward_names(cfg.rewards), cfg.rewards, strict=True)}
    else:
        summaries = {kind: RewardSummary(kind, kind, 1.0)
                     for kind in sorted({term["name"] for result in results for term in result.terms})}
    for result in results:
        for term in result.terms:
            summaries[term["name"]].add(term)
    return list(summaries.values())


def account_for(cfg: ScoreConfig, results: list[ScoreResult]) -> dict[str, dict[str, Any]]:
    """What a stage that scored `results` does with them: print one line per term to stderr (the stage's output;
    plain text, unwrapped, as a user's message may hold brackets), stop the stage when a function failed too often
    (check_failures), and return the manifest's `reward_functions` metrics (short name -> RewardSummary.metrics)."""
    summaries = summarize(cfg, results)
    for summary in summaries:
        print(f"  {summary.line()}", file=sys.stderr, flush=True)
    check_failures(cfg, summaries)
    return {summary.name: summary.metrics() for summary in summaries}


def combine_reward_metrics(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The `reward_functions` metrics of a sharded stage's whole table from its shards' (`account_for` of each):
    calls, errors and values summed, the mean weighted by each part's values, the first error of the first part."""
    combined: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(name for part in parts for name in part):
        terms = [part[name] for part in parts if name in part]
        calls, errors, values = (sum(term[key] for term in terms) for key in ("calls", "errors", "values"))
        weighted = [(term["mean"], term["values"]) for term in terms if term["mean"] is not None]
        combined[name] = {
            "fn": terms[0]["fn"], "weight": terms[0]["weight"], "calls": calls, "errors": errors,
            "error_frac": errors / calls if calls else 0.0, "values": values,
            "mean": sum(mean * n for mean, n in weighted) / values if weighted and values else None,
            "first_error": next((term["first_error"] for term in terms if term["first_error"]), None),
        }
    return combined


def check_failures(cfg: ScoreConfig, summaries: list[RewardSummary]) -> None:
    """An InputError (the stage fails with exit code 2) naming the first function whose failed calls are at least
    score.max_reward_error_fraction of its calls (and at least one): the default 1.0 stops a function that
    failed on every call it was given."""
    limit = cfg.max_reward_error_fraction
    for summary in summaries:
        if limit is not None and summary.errors and summary.error_frac >= limit:
            raise InputError(
                f"reward function {summary.name} ({summary.fn}) failed on {summary.errors} of {summary.calls} "
                f"calls (score.max_reward_error_fraction = {limit:g}); first: {summary.first_error}"
            )
