"""The process that runs user reward functions for the score stage, and `run_code` for those functions.

Started by rewards.RewardHost (`main()`, from `python -c`) in the stage's working directory. It
imports the entries it is given, reports their signature styles and where each is defined, then answers one
call per frame: the function's value reduced to a finite float (verl: a number or a dict's `score`; TRL: the
one item of the returned list, None meaning "does not apply"), or the error ending with the user's file:line
(for an exception, its deepest frame in the function's file; for a value that is not a finite number, the
function's own first line: the fault is the user's, whatever rlpipe line noticed it). A separate process because
a user function can hang or crash: the stage kills and restarts this process and goes on. Started with `tools`
(generate.multi_turn.tools, stages/sandbox/tools.py) it serves tool calls instead: the arguments as keywords,
the answer as text, an exception as its type and message (no file path: the model reads it).

`run_code(code, stdin, timeout_s, files)` is the documented way for a reward function to execute model-written
code: inside a reward call it asks the score stage, which runs it in its sandbox (the same isolation as the
built-in verifiers); called anywhere else it starts a one-worker sandbox of its own. Never exec model code in
a reward function: it would run with the function's (the stage's) privileges.
"""

from __future__ import annotations

import atexit
import base64
import inspect
import json
import math
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

from ._runner import read_frame, write_frame
from .rewards import load_function, signature_style

# (requests fd, replies fd) while serving the score stage; None in any other process.
_STAGE: tuple[int, int] | None = None
_OWN_SANDBOX: Any = None


@dataclass
class CodeRun:
    """What a `run_code` call gives back."""

    status: str  # ok (exit code 0) | failed (another exit code) | timeout | error (the sandbox could not run it)
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_code(
    code: str, stdin: str = "", timeout_s: float | None = None, files: dict[str, bytes] | None = None,
    fetch: list[str] | None = None,
) -> CodeRun:
    """Run Python `code` as a program in rlpipe's sandbox with `stdin`; `files` are written into its working
    directory first and the `fetch` files read back (relative paths). `timeout_s` defaults to score.timeout_s
    (at most 60 s)."""
    request = {
        "code": code, "stdin": stdin, "language": "python", "run_timeout": timeout_s,
        "files": {name: base64.b64encode(data).decode() for name, data in (files or {}).items()},
        "fetch_files": list(fetch or []),
    }
    return code_run_of(_ask_stage(request) if _STAGE is not None else _own_sandbox().run_code(request))


def _ask_stage(request: dict[str, Any]) -> dict[str, Any]:
    assert _STAGE is not None
    requests, replies = _STAGE
    write_frame(replies, json.dumps({"run_code": request}).encode())
    raw = read_frame(requests)
    if raw is None:
        raise SystemExit(0)  # the stage is gone
    return json.loads(raw)["run_code_reply"]


def _own_sandbox() -> Any:  # noqa: ANN401 - a started Sandbox
    global _OWN_SANDBOX
    if _OWN_SANDBOX is None:
        from schemas.config import ScoreConfig

        from .sandbox import Sandbox

        _OWN_SANDBOX = Sandbox(ScoreConfig(workers=1)).start()
        atexit.register(_OWN_SANDBOX.close)
    return _OWN_SANDBOX


def code_run_of(response: dict[str, Any]) -> CodeRun:
    """A sandbox's `run_code` response (SandboxFusion's shape) as a CodeRun."""
    run = response.get("run_result") or {}
    files = {name: base64.b64decode(data) for name, data in (response.get("files") or {}).items()}
    if not run:
        return CodeRun("error", None, "", response.get("message", ""), 0.0)
    exit_code = run.get("return_code")
    status = "timeout" if run.get("status") == "TimeLimitExceeded" else "ok" if exit_code == 0 else "failed"
    return CodeRun(status, exit_code, run.get("stdout", ""), run.get("stderr", ""),
                   float(run.get("execution_time") or 0.0), files)


def reward_value(style: str, result: Any) -> float | None:  # noqa: ANN401 - what the user's function returned
    """A verl result (a number, or a dict with `score`) or a TRL result (a list of one float or None) as a
    float, None for "does not apply"; TypeError for anything else."""
    if style == "verl" and isinstance(result, dict):
        if "score" not in result:
            raise TypeError(f"returned a dict without 'score': keys {sorted(result)}")
        result = result["score"]
    elif style == "trl":
        if not isinstance(result, list | tuple) or len(result) != 1:
            raise TypeError(f"must return a list with one value per completion (1), got {result!r:.100}")
        result = result[0]
        if result is None:
            return None
    if not (isinstance(result, bool | int | float) or hasattr(result, "__float__")):
        raise TypeError(f"returned {type(result).__name__} {result!r:.60}, not a number")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite value {value}")
    return value


def location(function: Any) -> str:  # noqa: ANN401 - a callable
    """`file:line` of the function's definition (through decorators that set __wrapped__), else its name."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None) or getattr(type(function).__call__, "__code__", None)
    if code is None:
        return getattr(function, "__qualname__", type(function).__name__)
    return f"{code.co_filename}:{code.co_firstlineno}"


def raised_at(error: BaseException, source: str) -> str:
    """Where `error` was raised, as `file:line`: its deepest frame in the user's file `source`, else its last."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if frame.filename == source] or frames[-1:]
    return f"{own[-1].filename}:{own[-1].lineno}" if own else source


def accepted(function: Any, arguments: dict[str, Any]) -> dict[str, Any]:  # noqa: ANN401 - a callable
    """The arguments `function` takes: all of them with **kwargs, else those it names (verl passes extra_info
    and TRL every column; a function need not declare what it does not use)."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return arguments
    names = {p.name for p in parameters}
    return {key: value for key, value in arguments.items() if key in names}


def main() -> None:
    global _STAGE
    # The protocol owns the original stdin/stdout; a function's prints go to stderr instead of into a frame.
    requests, replies = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    hello = json.loads(read_frame(requests) or b"{}")
    if "tools" in hello:
        return _serve_tools(hello["tools"], requests, replies)
    styles = []
    functions = []
    for index, fn in enumerate(hello["entries"]):
        try:
            functions.append(load_function(fn))
            styles.append(signature_style(functions[-1]))
        except Exception as error:
            write_frame(replies, json.dumps({"fatal": f"reward function {index} {fn!r}: {error}"}).encode())
            return
    locations = [location(function) for function in functions]
    write_frame(replies, json.dumps({"styles": styles, "locations": locations}).encode())
    _STAGE = (requests, replies)
    while (raw := read_frame(requests)) is not None:
        message = json.loads(raw)
        index = message["call"]
        function = functions[index]
        try:
            result = function(**accepted(function, message["arguments"]))
        except Exception as error:  # the user's code: any exception marks the row, never this process
            source = locations[index].rpartition(":")[0]
            reply: dict[str, Any] = {"error": f"{type(error).__name__}: {error}"[:900]
                                     + f" ({raised_at(error, source)})"}
        else:
            try:
                reply = {"value": reward_value(styles[index], result)}
            except Exception as error:  # noqa: BLE001 - a result that is not a finite number (its __float__ too)
                reply = {"error": f"{str(error)[:900]} ({locations[index]})"}
        write_frame(replies, json.dumps(reply).encode())


def _serve_tools(entries: list[dict[str, Any]], requests: int, replies: int) -> None:
    """The tool-call loop: build every tool, then one call per frame, answered `{"text"}` or `{"error"}`."""
    global _STAGE
    from schemas.config import ToolEntry

    from .tools import answer_text, callable_tool

    tools = []
    for index, raw in enumerate(entries):
        entry = ToolEntry.model_validate(raw)
        try:
            tools.append(callable_tool(entry))
        except Exception as error:
            write_frame(replies, json.dumps({"fatal": f"tool {index} {entry.fn!r}: {error}"}).encode())
            return
    write_frame(replies, json.dumps({"styles": ["tool"] * len(tools), "locations": [e["fn"] for e in entries]})
                .encode())
    _STAGE = (requests, replies)
    while (raw_call := read_frame(requests)) is not None:
        message = json.loads(raw_call)
        try:
            reply = {"text": answer_text(tools[message["call"]](message["arguments"]))}
        except Exception as error:  # the user's code: any exception is the call's observation
            reply = {"error": f"{type(error).__name__}: {error}"[:900]}
        write_frame(replies, json.dumps(reply).encode())
