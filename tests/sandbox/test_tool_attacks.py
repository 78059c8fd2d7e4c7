"""The multi-turn tool path (stages/generation/agent_loop.SandboxTool) runs model code through the scoring
sandbox: every attack program of test_attacks.py is contained there too and comes back as an observation, a
hanging call and an output flood included; nothing raises, no process is left behind."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from stages.generation.agent_loop import SandboxTool
from stages.sandbox import Sandbox

from .test_attacks import ATTACKS, local_listener


def tool_program(name: str, port: int) -> str:
    """The attack as a script: a function attack is called; a stdin attack gets its stdin from a StringIO."""
    attack = ATTACKS[name]
    if attack.expected is None:
        return attack.body + "\nprint(add(1, 2))\n"
    given = attack.stdin.format(pid=__import__("os").getpid(), port=port)
    return f"import io, sys\nsys.stdin = io.StringIO({given!r})\n" + attack.body


@pytest.mark.slow
def test_every_attack_through_the_tool_is_contained_and_observed(sandbox: Sandbox) -> None:
    tool = SandboxTool(sandbox, timeout_s=2.0, output_chars=300)
    listener = local_listener()
    names = list(ATTACKS)
    started = time.monotonic()
    results = tool.run([tool_program(name, listener.getsockname()[1]) for name in names])
    assert time.monotonic() - started < 6.0 * len(names)
    for name, result in zip(names, results, strict=True):
        attack = ATTACKS[name]
        if attack.expected is not None:  # the program prints `expected` only if the attack worked
            assert result.output.strip() != attack.expected.strip(), name
        assert len(result.output) <= 300 + 64 + 40, name
        assert result.seconds >= 0.0
    assert sandbox.leftover_processes() == 0
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()
    # The machine is still fine for an ordinary call afterwards.
    (after,) = tool.run(["print(6 * 7)"])
    assert (after.output, after.error) == ("42", False)


def test_a_hanging_call_and_a_flood_are_observations(sandbox: Sandbox) -> None:
    tool = SandboxTool(sandbox, timeout_s=1.0, output_chars=100)
    started = time.monotonic()
    hang, flood, crash, fine = tool.run([
        "import time\nprint('start', flush=True)\nwhile True:\n    time.sleep(0.01)",
        "while True:\n    print('x' * 10000)",
        "print('partial')\nraise ValueError('boom')",
        "print(sum(i * i for i in range(1, 101)))",
    ])
    assert time.monotonic() - started < 10.0
    assert hang.error and hang.output.startswith("start") and hang.output.endswith("ran longer than 1 s")
    assert flood.error and "[cut at 50 characters]" in flood.output
    assert "output exceeded 65536 bytes" in flood.output  # the sandbox's cap (score.output_limit_kb 64) ended it
    assert crash.error and crash.output.startswith("partial\n") and crash.output.endswith("ValueError: boom")
    assert (fine.output, fine.error) == ("338350", False)  # 1^2 + ... + 100^2 = 100*101*201/6
    assert sandbox.leftover_processes() == 0


def test_an_error_shows_the_programs_own_traceback_only(sandbox: Sandbox) -> None:
    """A program that raises inside the standard library (json) from a function of its own: the observation is
    its output, its own frames with their lines and the error line; no frame of rlpipe's runner or of the
    standard library, no host path. A syntax error shows its line and caret."""
    tool = SandboxTool(sandbox, timeout_s=2.0, output_chars=2000)
    raised, syntax = tool.run([
        "import json\n\ndef parse(text):\n    return json.loads(text)\n\nprint('parsing')\nparse('{oops')\n",
        "print('never')\ndef f(:\n    pass\n",
    ])
    assert raised.error and raised.output == (
        "parsing\n"
        "Traceback (most recent call last):\n"
        '  File "main.py", line 7, in <module>\n'
        "    parse('{oops')\n"
        '  File "main.py", line 4, in parse\n'
        "    return json.loads(text)\n"
        "           ^^^^^^^^^^^^^^^^\n"
        "json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    )
    assert syntax.error and syntax.output.startswith('  File "main.py", line 2\n    def f(:\n')
    assert syntax.output.endswith("SyntaxError: invalid syntax")
    for output in (raised.output, syntax.output):
        for host in (str(Path(__file__).parents[2]), "/work", "stages/sandbox", "_runner", "/usr/lib", sys.prefix):
            assert host not in output
