"""Score one job in a worker: dispatch on the reward spec's kind and build the ScoreResult fields.

- `code_tests` (HumanEval style): the program (preamble + candidate code) is loaded in a sandboxed child
  in `serve` mode; the judge (judge.py) runs the dataset's check statements here and calls the
  candidate through the channel. One wall-clock budget (`timeout_s`) covers loading and every test.
- `code_call`: call-based cases (`fn_name`, `inputs`, `outputs`), judged exactly like `code_tests`: the
  trusted side runs one generated assert per case (checks.call_test_source) and compares plain values.
- `code_stdio`: one sandboxed run of the program per case, stdin fed, stdout compared after normalising
  trailing whitespace (each line right-stripped, trailing blank lines dropped); `timeout_s` per case.
- `math`: the last \\boxed{} or <answer> is compared with the reference by math-verify.

Status vocabulary (results and per-test entries alike): ok | fail | timeout | error, plus no_code for a
response with nothing to grade.
"""

from __future__ import annotations

import base64
import os
import time
from dataclasses import dataclass, field
from typing import Any

from schemas.config import ScoreConfig

from .checks import CheckPlan, CheckSpecError, call_program, plan_calls, plan_checks
from .extract import extract_answer, extract_code, last_number
from .isolation import Isolation, SpawnError
from .judge import JobTimeout, TestOutcome, run_checks, summarize
from .process import PipeChannel, frame, pump

Result = dict[str, Any]


def make_result(
    cfg: ScoreConfig, status: str, tests: list[TestOutcome], code: str | None, started: float
) -> Result:
    passed = sum(test.passed for test in tests)
    total = len(tests)
    if status == "no_code":
        reward = cfg.no_code_penalty
    elif cfg.reward == "binary":
        reward = 1.0 if status == "ok" else 0.0
    else:
        reward = passed / total if total else 0.0
    return {
        "reward": float(reward),
        "passed": passed,
        "total": total,
        "status": status,
        "tests": [test.as_dict() for test in tests],
        "code": code,
        "seconds": time.monotonic() - started,
    }


def _all(names: list[str], status: str, message: str) -> list[TestOutcome]:
    return [TestOutcome(name, status, message) for name in names]


def _syntax_error(program: str) -> str | None:
    """Compiling never runs code, so a syntax error is found here without starting a process."""
    try:
        compile(program, "main.py", "exec")
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as error:
        return f"{type(error).__name__}: {error}"[:500]
    return None


def score_job(job: dict, cfg: ScoreConfig, isolation: Isolation) -> Result:
    started = time.monotonic()
    spec = job.get("reward_spec") or {}
    text = job.get("response_text") or ""
    kind = spec.get("kind")
    if kind == "math":
        return score_math(text, spec, cfg, started)
    code = extract_code(text)
    if kind == "code_tests":
        return score_code_tests(code, spec, cfg, isolation, started)
    if kind == "code_stdio":
        return score_stdio(code, spec, cfg, isolation, started)
    if kind == "code_call":
        return score_code_call(code, spec, cfg, isolation, started)
    return make_result(
        cfg, "error", [TestOutcome("reward_spec", "error", f"unknown kind {kind!r}")], code, started
    )


# -- function tests --------------------------------------------------------------------------------


def score_code_tests(
    code: str | None, spec: dict, cfg: ScoreConfig, isolation: Isolation, started: float
) -> Result:
    preamble = spec.get("preamble") or ""
    try:
        plan = plan_checks(preamble, spec.get("test") or "")
    except CheckSpecError as error:
        return make_result(cfg, "error", [TestOutcome("check", "error", str(error))], code, started)
    if code is None:
        return make_result(cfg, "no_code", _all(plan.test_names, "fail", "no code block"), None, started)
    # No syntax check here: the child compiles the program anyway and reports a SyntaxError as a load
    # error, and compiling twice was a visible share of a short job's CPU.
    program = preamble + "\n" + code if preamble else code
    deadline = started + cfg.timeout_s
    outcomes = run_in_sandbox(
        program, spec.get("entry_point") or "", plan, isolation, deadline, cfg.timeout_s
    )
    passed, total, status = summarize(outcomes)
    return make_result(cfg, status, outcomes, code, started)


def score_code_call(
    code: str | None, spec: dict, cfg: ScoreConfig, isolation: Isolation, started: float
) -> Result:
    fn_name = spec.get("fn_name") or ""
    try:
        _, plan = plan_calls(fn_name, spec.get("inputs"), spec.get("outputs"))
    except CheckSpecError as error:
        return make_result(cfg, "error", [TestOutcome("cases", "error", str(error))], code, started)
    if code is None:
        return make_result(cfg, "no_code", _all(plan.test_names, "fail", "no code block"), None, started)
    outcomes = run_in_sandbox(
        call_program(code, fn_name), fn_name, plan, isolation, started + cfg.timeout_s, cfg.timeout_s
    )
    _, _, status = summarize(outcomes)
    return make_result(cfg, status, outcomes, code, started)


def run_in_sandbox(
    program: str, entry_point: str, plan: CheckPlan, isolation: Isolation, deadline: float, budget_s: float
) -> list[TestOutcome]:
    """Load the program in a `serve` child and run the plan's tests against it; ends the job."""
    workdir = isolation.begin_job()
    request_read, request_write = os.pipe2(os.O_CLOEXEC)
    reply_read, reply_write = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    pid = None
    pidfd = None
    try:
        try:
            pid = isolation.spawn("serve", [null, null, null, request_read, reply_write], budget_s, workdir)
        except SpawnError as error:
            return _all(plan.test_names, "error", f"sandbox failed to start: {error}")
        finally:
            for fd in (request_read, reply_write, null):
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        os.set_blocking(request_write, False)
        os.set_blocking(reply_read, False)
        channel = PipeChannel(request_write, reply_read, deadline, pidfd)
        loaded = _load(channel, program, entry_point)
        if loaded is not None:
            return _all(plan.test_names, loaded[0], loaded[1])
        return run_checks(plan, channel, max(0.0, deadline - time.monotonic()), entry_point)
    finally:
        for fd in (request_write, reply_read, pidfd):
            if fd is not None:
                os.close(fd)
        if pid is not None:
            isolation.end_job(pid)


def _load(channel: PipeChannel, program: str, entry_point: str) -> tuple[str, str] | None:
    """Send the program; None when it loaded, else (status, message) for every test."""
    try:
        channel.send(frame("load", program, entry_point))
        reply = channel.receive()
    except JobTimeout:
        return "timeout", "wall-clock limit reached while loading the program"
    except BaseException as error:  # CandidateGone: exited or crashed on import
        return "error", f"program did not load: {error}"
    if reply == ("loaded",):
        return None
    detail = reply[1] if reply[0] == "error" and len(reply) == 2 else reply
    return "error", f"program did not load: {str(detail)[:500]}"


# -- stdin/stdout cases ----------------------------------------------------------------------------


def normalize_output(text: str) -> list[str]:
    """Lines with trailing whitespace removed and trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def score_stdio(
    code: str | None, spec: dict, cfg: ScoreConfig, isolation: Isolation, started: float
) -> Result:
    inputs = list(spec.get("inputs") or [])
    outputs = list(spec.get("outputs") or [])
    names = [f"case {index}" for index in range(len(inputs))]
    if len(inputs) != len(outputs) or not inputs:
        return make_result(
            cfg,
            "error",
            [TestOutcome("cases", "error", "inputs and outputs must be non-empty and of equal length")],
            code,
            started,
        )
    if code is None:
        return make_result(cfg, "no_code", _all(names, "fail", "no code block"), None, started)
    syntax = _syntax_error(code)
    if syntax is not None:
        return make_result(cfg, "error", _all(names, "error", syntax), code, started)
    outcomes = [
        run_case(code, str(stdin), str(expected), name, cfg, isolation)
        for name, stdin, expected in zip(names, inputs, outputs, strict=True)
    ]
    _, _, status = summarize(outcomes)
    return make_result(cfg, status, outcomes, code, started)


@dataclass
class ScriptRun:
    """One program run with stdin, as the worker saw it."""

    exit_code: int | None  # None when the worker ended it (timeout, output cap)
    stdout: str
    stderr: str
    timed_out: bool
    overflow: bool
    seconds: float
    files: dict[str, bytes] = field(default_factory=dict)


def _safe_relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts[:-1]


def run_script(
    code: str,
    stdin: str,
    timeout_s: float,
    isolation: Isolation,
    files: dict[str, bytes] | None = None,
    fetch: list[str] | None = None,
) -> ScriptRun:
    """Run `code` as __main__ in a fresh sandboxed process with `stdin`; optional input files are
    written into (and `fetch` files read back from) the job's directory, relative paths only."""
    started = time.monotonic()
    deadline = started + timeout_s
    workdir = isolation.begin_job()
    for name, content in (files or {}).items():
        if not _safe_relative(name):
            isolation.discard_job()
            raise ValueError(f"file path {name!r} must be relative and stay inside the job directory")
        target = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(content)
        if isolation.is_root:  # the job's uid owns its inputs, as if it had written them itself
            os.chown(target, isolation.uid, isolation.uid)
    stdin_read, stdin_write = os.pipe2(os.O_CLOEXEC)
    out_read, out_write = os.pipe2(os.O_CLOEXEC)
    err_read, err_write = os.pipe2(os.O_CLOEXEC)
    src_read, src_write = os.pipe2(os.O_CLOEXEC)
    pid = None
    pidfd = None
    fetched: dict[str, bytes] = {}
    try:
        try:
            fds = [stdin_read, out_write, err_write, src_read]
            pid = isolation.spawn("script", fds, timeout_s, workdir)
        except SpawnError:
            for fd in (stdin_write, out_read, err_read, src_write):
                os.close(fd)
            raise
        finally:
            for fd in (stdin_read, out_write, err_write, src_read):
                os.close(fd)
        pidfd = os.pidfd_open(pid)
        for fd in (stdin_write, out_read, err_read, src_write):
            os.set_blocking(fd, False)
        writes = {src_write: frame("source", code), stdin_write: stdin.encode()}
        data, timed_out, overflow = pump(
            writes, [out_read, err_read], isolation.limits.output_bytes, deadline, pidfd
        )
        for fd in (out_read, err_read):
            os.close(fd)
        exit_code = isolation.wait_exit(pid, deadline) if not (timed_out or overflow) else None
        timed_out = timed_out or (exit_code is None and not overflow)
        for name in fetch or []:
            target = os.path.join(workdir, name)
            if _safe_relative(name) and os.path.isfile(target) and not os.path.islink(target):
                with open(target, "rb") as handle:
                    fetched[name] = handle.read(isolation.limits.output_bytes)
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if pid is not None:
            isolation.end_job(pid)
        else:
            isolation.discard_job()
    return ScriptRun(
        exit_code=exit_code,
        stdout=data.get(out_read, b"").decode(errors="replace"),
        stderr=data.get(err_read, b"").decode(errors="replace"),
        timed_out=timed_out,
        overflow=overflow,
        seconds=time.monotonic() - started,
        files=fetched,
    )


def run_case(
    code: str, stdin: str, expected: str, name: str, cfg: ScoreConfig, isolation: Isolation
) -> TestOutcome:
    try:
        run = run_script(code, stdin, cfg.timeout_s, isolation)
    except SpawnError as error:
        return TestOutcome(name, "error", f"sandbox failed to start: {error}")
    if run.overflow:
        return TestOutcome(name, "error", f"output exceeded {isolation.limits.output_bytes} bytes")
    if run.timed_out:
        return TestOutcome(name, "timeout", f"no result within {cfg.timeout_s} s")
    if run.exit_code != 0:
        tail = run.stderr.strip().splitlines()[-1:] or [""]
        return TestOutcome(name, "error", f"exit code {run.exit_code}: {tail[0][:300]}")
    if normalize_output(run.stdout) == normalize_output(expected):
        return TestOutcome(name, "ok")
    return TestOutcome(name, "fail", f"expected {expected[:100]!r}, got {run.stdout[:100]!r}")


# -- raw runs (the /run_code API) -----------------------------------------------------------------

MAX_RUN_TIMEOUT_S = 60.0


def run_code_request(request: dict, cfg: ScoreConfig, isolation: Isolation) -> dict:
    """SandboxFusion's /run_code semantics for Python: run `code` with `stdin`, report status,
    run_result (status Finished | TimeLimitExceeded | Error, execution_time, return_code, stdout,
    stderr) and the requested files (base64)."""
    language = request.get("language") or "python"
    if language not in ("python", "python3"):
        return _run_response("SandboxError", f"language {language!r} is not supported here (python only)")
    try:
        encoded = request.get("files") or {}
        files = {name: base64.b64decode(content or "") for name, content in encoded.items()}
        timeout_s = min(float(request.get("run_timeout") or cfg.timeout_s), MAX_RUN_TIMEOUT_S)
        run = run_script(
            str(request.get("code") or ""),
            str(request.get("stdin") or ""),
            timeout_s,
            isolation,
            files,
            list(request.get("fetch_files") or []),
        )
    except (ValueError, TypeError, SpawnError) as error:
        return _run_response("SandboxError", str(error))
    stderr = run.stderr
    if run.overflow:
        stderr += f"\n[output exceeded {isolation.limits.output_bytes} bytes]"
    result = {
        "status": "TimeLimitExceeded" if run.timed_out else "Finished",
        "execution_time": run.seconds,
        "return_code": run.exit_code if run.exit_code is not None else (-9 if run.overflow else None),
        "stdout": run.stdout,
        "stderr": stderr,
    }
    ok = result["status"] == "Finished" and run.exit_code == 0
    response = _run_response("Success" if ok else "Failed", "")
    response["run_result"] = result
    response["files"] = {name: base64.b64encode(data).decode() for name, data in run.files.items()}
    return response


def _run_response(status: str, message: str) -> dict:
    return {
        "status": status,
        "message": message,
        "compile_result": None,
        "run_result": None,
        "executor_pod_name": None,
        "files": {},
    }


# -- math answers ----------------------------------------------------------------------------------


def score_math(text: str, spec: dict, cfg: ScoreConfig, started: float) -> Result:
    answer = extract_answer(text)
    if answer is None and cfg.math_answer == "flexible":
        answer = last_number(text)
    if answer is None:
        missing = "no \\boxed{}, <answer> or number" if cfg.math_answer == "flexible" else "no \\boxed{} or <answer>"
        return make_result(cfg, "no_code", [TestOutcome("answer", "fail", missing)], None, started)
    ok, message = math_equal(answer, str(spec.get("answer", "")), cfg.timeout_s)
    outcome = TestOutcome("answer", "ok" if ok else "fail", message)
    return make_result(cfg, "ok" if ok else "fail", [outcome], answer, started)


def math_equal(answer: str, reference: str, timeout_s: float) -> tuple[bool, str]:
    """math-verify equivalence; its own signal-based timeouts only work on the main thread."""
    import threading

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    main = threading.current_thread() is threading.main_thread()
    seconds = max(1, int(timeout_s)) if main else None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        gold = parse(f"${reference}$", extraction_config=configs, parsing_timeout=seconds) or parse(
            reference, extraction_config=configs, parsing_timeout=seconds
        )
        predicted = parse(f"${answer}$", extraction_config=configs, parsing_timeout=seconds) or parse(
            answer, extraction_config=configs, parsing_timeout=seconds
        )
        if not gold:
            return False, f"reference {reference!r} does not parse"
        if not predicted:
            return False, f"answer {answer!r} does not parse"
        equal = bool(verify(gold, predicted, timeout_seconds=seconds))
    except Exception as error:  # math-verify raises on pathological input; that answer is not correct
        return False, f"{type(error).__name__}: {error}"[:300]
    return equal, "" if equal else f"{answer!r} is not equivalent to {reference!r}"
