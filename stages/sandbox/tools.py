"""generate.multi_turn.tools: each tool's OpenAI function schema, and how a user tool is built and called.

A tool is the built-in code interpreter (schema `CODE_INTERPRETER_SCHEMA`, one `code` argument, run in the
sandbox by the agent loop), a user function, or a verl `BaseTool`-style class; its schema is the entry's
`tool_schema` or the object's own `tool_schema` attribute (one rule for both), normalized to OpenAI's
`{"type": "function", "function": {name, description, parameters}}`, which is what chat templates read as
`tools=`. The schemas are read where the prompts are rendered (an import, as `rlpipe run` already imports user
reward functions to check them); calls run in the reward-function host (reward_host.py, `RewardHost` with
tools), so a tool that hangs or crashes costs its call, never the stage. A class is built once per host as
`Class(config=..., tool_schema=...)` (the schema as a dict); each call is verl's `create`, `execute(instance_id,
parameters)` and `release`, awaited when they are coroutines. A tool's answer becomes text: a string as it
is, verl's `{"text": ...}` or an object with `.text` their text, anything else its JSON.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

from schemas.config import CODE_INTERPRETER, MultiTurnConfig, ToolEntry

from .rewards import RewardSetupError, load_function

CODE_INTERPRETER_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": CODE_INTERPRETER,
        "description": "Run a Python program in a sandbox and return what it printed (stdout, then the end of "
                       "stderr). Nothing persists between calls: print what you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The whole Python program to run."}},
            "required": ["code"],
        },
    },
}


def entry_label(index: int, entry: ToolEntry) -> str:
    return f"generate.multi_turn.tools[{index}] {entry.fn!r}"


def normalized_schema(schema: Any) -> dict[str, Any]:  # noqa: ANN401 - whatever the user gave
    """`schema` as `{"type": "function", "function": {...}}` with a name and an object `parameters`; a
    RewardSetupError saying what is missing otherwise."""
    if not isinstance(schema, dict):
        raise RewardSetupError("has no schema: give `tool_schema` in the entry or a `tool_schema` dict attribute "
                               "(OpenAI function format: name, description, parameters)")
    function = schema.get("function", schema) if schema.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise RewardSetupError("its schema has no function name (OpenAI function format: name, description, "
                               "parameters)")
    parameters = function.get("parameters")
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise RewardSetupError(f"its schema {function['name']!r} has no `parameters` object (a JSON schema with "
                               "type: object)")
    return {"type": "function", "function": function}


def user_tool_schema(entry: ToolEntry, tool: Any) -> dict[str, Any]:  # noqa: ANN401 - a function or class
    return normalized_schema(entry.tool_schema if entry.tool_schema is not None else getattr(tool, "tool_schema", None))


def tool_schemas(cfg: MultiTurnConfig) -> list[dict[str, Any]]:
    """Every configured tool's normalized schema, in order: the code interpreter's, a user tool's (imported
    here for it); a RewardSetupError naming the entry for one that does not import or has no schema, and for
    two tools of one name."""
    schemas = []
    for index, entry in enumerate(cfg.tool_entries()):
        try:
            schemas.append(CODE_INTERPRETER_SCHEMA if entry.fn == CODE_INTERPRETER
                           else user_tool_schema(entry, load_function(entry.fn)))
        except Exception as error:  # import errors of any type, raised by the user's module
            message = str(error) if isinstance(error, RewardSetupError) else f"{type(error).__name__}: {error}"
            raise RewardSetupError(f"{entry_label(index, entry)}: {message}") from None
        name = schemas[-1]["function"]["name"]
        if [s["function"]["name"] for s in schemas].count(name) > 1:
            raise RewardSetupError(f"{entry_label(index, entry)}: a second tool named {name!r}")
    return schemas


def check_tools(cfg: MultiTurnConfig) -> None:
    """What `rlpipe run` checks before the first stage: in tool mode with hermes calls, every tool imports and
    has a schema."""
    if cfg.mode == "tool" and cfg.code_format == "hermes":
        tool_schemas(cfg)


def callable_tool(entry: ToolEntry) -> Callable[[dict[str, Any]], Any]:
    """A user tool as `call(arguments) -> answer`: a function called with the arguments as keywords, or one
    instance of a BaseTool-style class whose `create`/`execute`/`release` each call runs."""
    tool = load_function(entry.fn)
    if not inspect.isclass(tool):
        return lambda arguments: tool(**arguments)
    instance = tool(config=entry.config, tool_schema=user_tool_schema(entry, tool))

    async def execute(arguments: dict[str, Any]) -> Any:  # noqa: ANN401 - the tool's response
        created = await _maybe_awaited(instance.create()) if hasattr(instance, "create") else None
        instance_id = created[0] if isinstance(created, tuple) else created
        try:
            outcome = await _maybe_awaited(instance.execute(instance_id, arguments))
        finally:
            if hasattr(instance, "release"):
                await _maybe_awaited(instance.release(instance_id))
        return outcome[0] if isinstance(outcome, tuple) else outcome  # (response, reward, metrics)

    return lambda arguments: asyncio.run(execute(arguments))


async def _maybe_awaited(value: Any) -> Any:  # noqa: ANN401 - a coroutine's result or a plain value
    return await value if inspect.isawaitable(value) else value


def answer_text(answer: Any) -> str:  # noqa: ANN401 - what a tool returned
    """A tool's answer as observation text."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, dict) and isinstance(answer.get("text"), str):
        return answer["text"]
    if isinstance(getattr(answer, "text", None), str):
        return answer.text
    return json.dumps(answer, default=str)
