"""The multi-turn agent loop (generate.multi_turn): a code-interpreter tool or test-feedback retries.

Two loops, the same turns. Per turn (any `Backend`: HF, the warm engine's client, vLLM with
`continuous_batching: false`): each turn is one `backend.generate` call per group of unfinished conversations
that share a token budget, so a turn is batched as a single-turn generation is, but waits for its slowest
member and later turns decode only the conversations still going. Continuous (a backend with sessions,
base.TurnSession: in-process vLLM): a turn enters the engine as soon as its conversation's tool call or judgement
returns (a thread pool), while the others decode; the tokens then depend on when calls return, so such a run is
not reproducible (generate's manifest: `deterministic: false`). A turn's request is the prompt plus every
token so far; the model's sampled tokens are kept as sampled (never re-tokenized), and the tokens between turns
(observations) are the chat template's rendering of the added message, found as the text after a placeholder
assistant message (prefix diff), or `<interpreter>` text that continues the model's own turn. Observation
tokens get loss_mask 0 and logprob 0.0. Turn 0 uses the sample's own seed (so it draws what single-turn
generation would), turn t a seed derived from (seed, t).

tool mode: a turn that ends at the code stop sequence (the closing ``` fence, or </code>) is a tool call; the
stop string `\n```\n` also matches a bare opening fence, so a turn stopped where no block was open goes on (the
same turn, another request: no stop string can tell the two, on any backend). A call's last code block runs
through the sandbox's run_code path (the scoring sandbox's isolation, a per-call timeout, output cap), and
what came out, an error, a timeout or a flood included, is the next observation: a tool call never fails the
stage. `code_format: hermes`: the turn stops at `</tool_call>` and each `<tool_call>{"name", "arguments"}` of it
runs in order (Toolbox: code_interpreter in the sandbox, user tools in the reward-function host), a call that
does not parse or fit its schema an error observation. A turn that ends otherwise (eos, its length) is the final
answer. feedback mode: every answer is scored
by the score stage's scorer; a failed one gets the failing tests back as a user turn (`feedback_tests`: their
names and messages, or only how many failed and the error types), up to max_turns; each turn's reward is kept.
Observation and feedback text is tokenized with special tokens split: a program cannot print a control token.
The conversation's token budget cuts it (finish_reason `budget`).
`roll_out` (what the generate and evaluate stages call) runs the loop with a sandbox started from the score
config as its tool or judge.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from schemas.config import CODE_INTERPRETER, MultiTurnConfig, ScoreConfig
from schemas.errors import InputError
from stages.generation.base import Backend, GenerationRequest, Sample, SamplingSpec, TurnSession, sessions
from stages.generation.sampling import generate_with_progress
from storage.progress import progress_bar

if TYPE_CHECKING:
    from stages.sandbox.rewards import RewardInput

# Finish reasons of a conversation: the model's final answer ("stop"), its last turn hit the per-turn token cap
# ("length"), the conversation budget ran out ("budget"), or a tool call was refused at a limit.
FINISH_REASONS = ("stop", "length", "budget", "max_turns", "max_tool_calls")
TRUNCATING = ("length", "budget")
CODE_STOPS = {"markdown": "\n```\n", "code_tags": "</code>", "hermes": "</tool_call>"}
PLACEHOLDER = "RLPIPE-TURN-PLACEHOLDER-1b7e"
CONTENT_PLACEHOLDER = "RLPIPE-CONTENT-PLACEHOLDER-5c2a"
# A fence line: ``` and an info string (no backticks) opens a block; only a bare ``` line closes one
# (stages/sandbox/extract.py reads blocks the same way).
_FENCE_LINE = re.compile(r"[ \t]*```[ \t]*([^`]*?)[ \t]*")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ERROR_TYPE = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b")


def turn_seed(seed: int, turn: int, part: int = 0) -> int:
    """Turn 0 keeps the sample's seed; turn t >= 1 gets a 63-bit hash of (seed, t); part p >= 1 of a turn that
    went on past a bare opening fence a hash of (seed, t, p)."""
    if turn == 0 and part == 0:
        return seed
    key = f"{seed}:turn:{turn}" + (f":part:{part}" if part else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") >> 1


def ends_inside_block(text: str) -> bool:
    """Whether markdown `text` (its complete lines) ends inside an open ``` block: an opening fence that the
    code stop `\n```\n` matched when it was bare, so no code has been written yet."""
    inside = False
    for line in text.split("\n")[:-1]:
        fence = _FENCE_LINE.fullmatch(line)
        if fence and (not inside or not fence.group(1)):
            inside = not inside
    return inside


def final_answer(messages: list[dict[str, str]]) -> str:
    """A conversation's last assistant message: what the score and evaluate stages grade."""
    return next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")


@dataclass
class ConversationStart:
    """One sample to roll out: its prompt (messages and the tokens the model saw) and its seed."""

    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    seed: int


@dataclass
class Conversation:
    """One sample's whole rollout, in the rollouts table's multi-turn terms (schemas/tables.py)."""

    start: ConversationStart
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[list[int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    turn_passed: list[bool] = field(default_factory=list)  # feedback mode: each answer passed every test
    messages: list[dict[str, str]] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    finish_reason: str | None = None
    turn_cut: bool = False  # the last turn ended at its token cap
    open_block: bool = False  # the last turn stopped at a bare opening fence: it goes on (the same turn)
    parts: int = 0  # generate calls of the last turn so far

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def final_answer(self) -> str:
        return final_answer(self.messages)

    def columns(self) -> dict[str, Any]:
        """The rollouts row's multi-turn columns and finish reason."""
        finish = self.finish_reason or "stop"
        return {
            "finish_reason": finish, "truncated": finish in TRUNCATING, "loss_mask": self.loss_mask,
            "turn_spans": self.turn_spans, "turn_rewards": self.turn_rewards or None, "num_turns": self.num_turns,
            "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
            "tool_seconds": round(self.tool_seconds, 6), "conversation": json.dumps(self.messages),
        }


@dataclass
class ToolResult:
    output: str  # what the observation shows
    error: bool  # raised, timed out, flooded, or the sandbox could not run it
    seconds: float


@dataclass
class ToolCall:
    """One call a turn makes: a tool's name and arguments, or why it cannot run (`error`, the observation)."""

    name: str
    arguments: dict[str, Any]
    error: str = ""


class SandboxTool:
    """The code interpreter: a started sandbox's `run_code` (Sandbox or FusionSandbox), calls run in parallel."""

    def __init__(self, sandbox: Any, timeout_s: float, output_chars: int) -> None:  # noqa: ANN401 - a sandbox
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.output_chars = output_chars
        self.threads = max(1, len(getattr(sandbox, "workers", [])) or 4)

    def run(self, codes: list[str]) -> list[ToolResult]:
        with ThreadPoolExecutor(self.threads, thread_name_prefix="tool") as pool:
            return list(pool.map(self.run_one, codes))

    def run_one(self, code: str) -> ToolResult:
        from stages.sandbox.reward_host import code_run_of

        started = time.monotonic()
        request = {"code": code, "stdin": "", "language": "python", "run_timeout": self.timeout_s,
                   "files": {}, "fetch_files": []}
        try:
            run = code_run_of(self.sandbox.run_code(request))
        except Exception as error:  # noqa: BLE001 - a sandbox failure is the model's observation, not the stage's
            return ToolResult(f"sandbox error: {error}", True, time.monotonic() - started)
        # stdout from its start, stderr from its end (where a traceback names the error), half the cap each at most
        half = self.output_chars // 2
        parts = [cap(run.stdout.strip("\n"), self.output_chars if not run.stderr.strip() else half)]
        if run.status == "error":
            parts = [f"sandbox error: {run.stderr.strip()}"]
        elif run.stderr.strip():
            parts.append(cap_tail(run.stderr.strip("\n"), half))
        if run.status == "timeout":
            parts.append(f"TimeoutError: the code ran longer than {self.timeout_s:g} s")
        text = "\n".join(part for part in parts if part)
        return ToolResult(cap(text, self.output_chars + 64), run.status != "ok", run.seconds)


class Toolbox:
    """Runs a turn's calls in order: the code interpreter's in the sandbox (SandboxTool), a user tool's in the
    reward-function host (rewards.RewardHost started with tools, one call at a time); a call that cannot run,
    fails, times out or whose host crashed is an error observation. `schemas` are the tools' OpenAI schemas."""

    def __init__(self, interpreter: SandboxTool, schemas: list[dict[str, Any]] | None = None,
                 host: Any = None, host_tools: list[str] | None = None) -> None:  # noqa: ANN401 - a RewardHost
        from stages.sandbox.tools import CODE_INTERPRETER_SCHEMA

        self.interpreter = interpreter
        self.schemas = schemas or [CODE_INTERPRETER_SCHEMA]
        self.host = host
        self.host_index = {name: index for index, name in enumerate(host_tools or [])}
        self.threads = interpreter.threads
        self.host_lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self.schemas]

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        return [self.run_one(call) for call in calls]

    def run_each(self, batches: list[list[ToolCall]]) -> list[list[ToolResult]]:
        """Each conversation's calls in order, the conversations in parallel."""
        with ThreadPoolExecutor(self.threads, thread_name_prefix="tool") as pool:
            return list(pool.map(self.run, batches))

    def run_one(self, call: ToolCall) -> ToolResult:
        if call.error:
            return ToolResult(call.error, True, 0.0)
        if call.name == CODE_INTERPRETER:
            code = call.arguments.get("code")
            if not isinstance(code, str):
                return ToolResult("error: the argument 'code' must be a string", True, 0.0)
            return self.interpreter.run_one(code)
        if call.name not in self.host_index:
            return ToolResult(f"error: no tool named {call.name!r}", True, 0.0)
        with self.host_lock:
            answer = self.host.call(self.host_index[call.name], call.arguments)
        if answer.error:
            return ToolResult(cap(f"error: {answer.error}", self.interpreter.output_chars), True, answer.seconds)
        return ToolResult(cap(answer.text, self.interpreter.output_chars), False, answer.seconds)


def hermes_calls(text: str, schemas: list[dict[str, Any]]) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of a turn's text, in order; one whose JSON
    does not parse, names no tool of `schemas` or lacks a required argument carries its error."""
    functions = {schema["function"]["name"]: schema["function"] for schema in schemas}
    bodies = _TOOL_CALL.findall(text)
    if not bodies:
        return [ToolCall("", {}, "error: no tool call found: write <tool_call>{\"name\": ..., \"arguments\": {...}}"
                                 "</tool_call>")]
    return [hermes_call(body.strip(), functions) for body in bodies]


def hermes_call(body: str, functions: dict[str, dict[str, Any]]) -> ToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall("", {}, f"error: the tool call is not valid JSON ({error})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall("", {}, 'error: the tool call is not a JSON object with a "name"')
    name, arguments = call["name"], call.get("arguments", {})
    if name not in functions:
        return ToolCall(name, {}, f"error: no tool named {name!r} (tools: {', '.join(functions)})")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"error: the arguments of {name!r} are not a JSON object")
    missing = [p for p in functions[name]["parameters"].get("required", []) if p not in arguments]
    if missing:
        return ToolCall(name, arguments, f"error: {name!r} is missing the required arguments: {', '.join(missing)}")
    return ToolCall(name, arguments)


def cap(text: str, chars: int) -> str:
    """`text` cut to its first `chars` characters, the cut marked."""
    return text if len(text) <= chars else text[:chars] + f"\n... [cut at {chars} characters]"


def cap_tail(text: str, chars: int) -> str:
    """`text` cut to its last `chars` characters, the cut marked."""
    return text if len(text) <= chars else f"[... cut to the last {chars} characters]\n" + text[-chars:]


# (index of the conversation, its answer text) -> (reward, passed, feedback message) per answer
Judge = Callable[[list[int], list[str]], list[tuple[float, bool, str]]]


def feedback_message(tests: list[dict[str, Any]], status: str, chars: int, show_tests: bool = False) -> str:
    """The user turn after a failed answer, capped: each failing test's name, status and message (`show_tests`),
    or only how many tests failed and their error types, so no test's text (inputs, expected values) is shown."""
    failing = [t for t in tests if not t.get("passed")]
    if status == "no_code":
        lines = ["No code block was found in your answer."]
    elif not failing:
        lines = [f"- the answer's status was {status}"]
    elif show_tests:
        lines = [f"- {t.get('name', '?')}: {t.get('status', 'fail')}" + (f": {t['message']}" if t.get("message")
                                                                          else "") for t in failing]
    else:
        kinds = Counter(error_type(t) for t in failing)
        lines = [f"- {len(failing)} of {len(tests)} tests failed: "
                 + ", ".join(f"{kind}" + (f" x{n}" if n > 1 else "") for kind, n in sorted(kinds.items()))]
    body = cap("\n".join(lines), chars)
    return f"Your answer failed these tests:\n{body}\nFix the code and give the whole corrected solution."


def error_type(test: dict[str, Any]) -> str:
    """A failing test's exception name (`AssertionError`) when its message starts with one, else its status."""
    named = _ERROR_TYPE.match(test.get("message") or "")
    return named.group(0) if named else str(test.get("status") or "fail")


def sandbox_judge(sandbox: Any, score_cfg: Any, specs: list[dict], inputs: list[Any], chars: int,  # noqa: ANN401
                  show_tests: bool = False) -> Judge:
    """A Judge that scores answers with the score stage's scorer (stages/sandbox/rewards.score); its feedback
    shows the failing tests' text only with `show_tests` (training with `feedback_tests: all`)."""
    from stages.sandbox import ScoreJob, rewards

    def judge(indices: list[int], texts: list[str]) -> list[tuple[float, bool, str]]:
        jobs = [ScoreJob(text, specs[i]) for i, text in zip(indices, texts, strict=True)]
        results = rewards.score(sandbox, score_cfg, jobs, [inputs[i] for i in indices])
        return [(r.reward, r.status == "ok", feedback_message(r.tests, r.status, chars, show_tests))
                for r in results]

    return judge


class ObservationTokens:
    """Observation text and tokens: the chat template's rendering of added messages, or interpreter text."""

    def __init__(self, tokenizer: Any, cfg: MultiTurnConfig,  # noqa: ANN401 - a HF tokenizer
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools  # the schemas the prompt was rendered with (hermes calls)
        template = getattr(tokenizer, "chat_template", None) or ""
        fmt = cfg.observation_format
        self.tool_role = fmt == "tool_role" or (fmt == "auto" and "tool" in template)
        if cfg.mode == "tool" and cfg.code_format == "hermes" and "tool" not in template:
            raise InputError("generate.multi_turn.code_format hermes answers with `tool` messages, and the chat "
                             "template has no tool role: set model.chat_template to one that has (such as "
                             "deployments/templates/qwen2.5-tools.jinja)")
        self.special_ids = set(tokenizer.all_special_ids)

    def encode(self, text: str) -> list[int]:
        """The chat template's own text: its control tokens are live."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_content(self, text: str) -> list[int]:
        """Text a program or a test wrote: special tokens split into plain characters, so an output that prints
        `<|im_end|>` can never end a turn or forge one."""
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def templated(self, messages: list[dict[str, str]], added: list[dict[str, str]], last_token: int | None) -> str:
        """The template's text for `added` after an assistant turn, up to the next assistant generation prompt.

        Rendered after a placeholder assistant message; the part of the assistant's closing that the model
        already sampled (its end-of-turn token) is not repeated."""
        rendered = self.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": PLACEHOLDER}, *added], add_generation_prompt=True,
            tokenize=False, tools=self.tools,
        )
        after = rendered[rendered.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
        if last_token is not None and last_token in self.special_ids:
            own = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if own and after.startswith(own):
                after = after[len(own):]
        return after

    def message(self, messages: list[dict[str, str]], role: str, contents: list[str],
                last_token: int | None) -> list[int]:
        """The template's rendering of added messages of one role: its framing encoded as template text, each of
        `contents` with special tokens split."""
        holders = [f"{CONTENT_PLACEHOLDER}-{i}-" for i in range(len(contents))]
        rest = self.templated(messages, [{"role": role, "content": holder} for holder in holders], last_token)
        tokens: list[int] = []
        for holder, content in zip(holders, contents, strict=True):
            if rest.count(holder) != 1:
                raise ValueError(f"the chat template does not render a {role} message's content once and verbatim")
            before, rest = rest.split(holder)
            tokens += self.encode(before) + self.encode_content(content)
        return tokens + self.encode(rest)

    def tool(self, messages: list[dict[str, str]], outputs: list[str], last_token: int | None) -> list[int]:
        """One turn's tool outputs: `tool` messages, or interpreter text one after the other."""
        if self.tool_role:
            return self.message(messages, "tool", outputs, last_token)
        return self.encode_content("".join(f"<interpreter>\n{output}\n</interpreter>\n" for output in outputs))

    def user(self, messages: list[dict[str, str]], text: str, last_token: int | None) -> list[int]:
        return self.message(messages, "user", [text], last_token)


def tool_code(text: str, code_format: str) -> str | None:
    """The code of a turn that ended at the code stop sequence: its last ```python block or <code> body."""
    if code_format == "code_tags":
        start = text.rfind("<code>")
        end = text.rfind("</code>")
        body = text[start + len("<code>"):end] if 0 <= start < end else ""
        return body.strip("\n") + "\n" if body.strip() else None
    from stages.sandbox import extract_code

    return extract_code(text)


def uses_continuous_batching(backend: Backend, cfg: MultiTurnConfig) -> bool:
    """Whether the loop batches continuously across turns: the config asks for it and the backend has sessions."""
    return cfg.continuous_batching and sessions(backend) is not None


def run_conversations(
    backend: Backend,
    tokenizer: Any,  # noqa: ANN401 - a HF tokenizer
    cfg: MultiTurnConfig,
    starts: list[ConversationStart],
    sampling: SamplingSpec,
    label: str,
    tool: SandboxTool | Toolbox | None = None,
    judge: Judge | None = None,
) -> tuple[list[Conversation], dict[str, float]]:
    """Roll out every conversation; returns them and the loop's figures (generation seconds and model tokens,
    the seconds the engine sat idle waiting for tool calls or the judge, and whether the loop was continuous).
    `sampling.max_new_tokens` caps each turn; `cfg.max_response_tokens` the whole conversation. `tool`: the
    tools (a Toolbox), or the code interpreter alone (a SandboxTool)."""
    if cfg.mode == "tool" and tool is None:
        raise ValueError("multi_turn mode tool needs a SandboxTool or a Toolbox")
    if cfg.mode == "feedback" and judge is None:
        raise ValueError("multi_turn mode feedback needs a judge")
    toolbox = Toolbox(tool) if isinstance(tool, SandboxTool) else tool
    turns = TurnRules(tokenizer, cfg, sampling, toolbox.schemas if toolbox and cfg.code_format == "hermes" else None)
    conversations = [Conversation(start) for start in starts]
    continuous = uses_continuous_batching(backend, cfg)
    figures = {"generation_seconds": 0.0, "generated_tokens": 0, "tool_wall_seconds": 0.0, "judge_seconds": 0.0,
               "continuous_batching": int(continuous)}
    if continuous:
        _run_continuous(sessions(backend), turns, conversations, label, toolbox, judge, figures)  # type: ignore[arg-type]
    else:
        _run_per_turn(backend, turns, conversations, label, toolbox, judge, figures)
    for c in conversations:
        c.finish_reason = c.finish_reason or "max_turns"
    return conversations, figures


def roll_out(
    backend: Backend, tokenizer: Any, multi_turn: MultiTurnConfig, score: ScoreConfig,  # noqa: ANN401 - a HF tokenizer
    starts: list[ConversationStart], sampling: SamplingSpec, specs: list[dict], inputs: list[RewardInput], label: str,
    held_out: bool = False, tools: list[dict[str, Any]] | None = None,
) -> tuple[list[Conversation], dict[str, Any]]:
    """`run_conversations` with a sandbox started from `score` as its code interpreter or its judge, and the
    reward-function host serving the user tools (what the generate and evaluate stages run); `tools`: the
    schemas the prompts were rendered with (`template_tools`); `held_out` (evaluation): feedback never shows a
    test's text, whatever `feedback_tests` says. A reward entry or tool that cannot be used is bad input."""
    from stages.sandbox import Sandbox, rewards

    user_tools = [(entry, schema) for entry, schema in zip(multi_turn.tool_entries(), tools or [], strict=False)
                  if entry.fn != CODE_INTERPRETER]
    with (Sandbox.from_config(score) as sandbox,
          rewards.RewardHost([], multi_turn.tool_timeout_s, sandbox.run_code,
                             tools=[entry.model_dump() for entry, _ in user_tools]) as host):
        interpreter = SandboxTool(sandbox, multi_turn.tool_timeout_s, multi_turn.tool_output_chars)
        tool = (Toolbox(interpreter, tools, host, [schema["function"]["name"] for _, schema in user_tools])
                if multi_turn.mode == "tool" else None)
        judge = (sandbox_judge(sandbox, score, specs, inputs, multi_turn.feedback_chars,
                               show_tests=multi_turn.feedback_tests == "all" and not held_out)
                 if multi_turn.mode == "feedback" else None)
        try:
            return run_conversations(backend, tokenizer, multi_turn, starts, sampling, label, tool=tool, judge=judge)
        except rewards.RewardSetupError as error:
            raise InputError(str(error)) from None


def template_tools(cfg: MultiTurnConfig) -> list[dict[str, Any]] | None:
    """The tool schemas the chat template is given as `tools=` (prompts and observations): every configured
    tool's with hermes calls in tool mode, else none. A tool that does not import or has no schema is bad input."""
    if cfg.mode != "tool" or cfg.code_format != "hermes":
        return None
    from stages.sandbox.rewards import RewardSetupError
    from stages.sandbox.tools import tool_schemas

    try:
        return tool_schemas(cfg)
    except RewardSetupError as error:
        raise InputError(str(error)) from None


def conversation_sample(c: Conversation, tokenizer: Any) -> Sample:  # noqa: ANN401 - a HF tokenizer
    """A conversation as one Sample: its whole token sequence, the decoded whole as text."""
    text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
    return Sample(c.token_ids, c.logprobs, text, c.finish_reason or "stop")


class TurnRules:
    """What both loops share: a turn's request and sampling, and what a finished turn does to its conversation."""

    def __init__(self, tokenizer: Any, cfg: MultiTurnConfig, sampling: SamplingSpec,  # noqa: ANN401
                 tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.sampling = sampling
        self.tools = tools  # hermes: the schemas calls are checked against (and the template's `tools=`)
        self.observe = ObservationTokens(tokenizer, cfg, tools)
        self.code_stop = CODE_STOPS[cfg.code_format]
        self.stops = [*sampling.stop, self.code_stop] if cfg.mode == "tool" else list(sampling.stop)

    def turn_room(self, c: Conversation) -> int:
        """Tokens the next request may add to its turn: the per-turn cap, less what an open turn already has."""
        used = c.turn_spans[-1][1] - c.turn_spans[-1][0] if c.open_block else 0
        return self.sampling.max_new_tokens - used

    def max_new(self, c: Conversation) -> int:
        """The next request's token cap: what is left of its turn's cap, or of the conversation's budget."""
        return min(self.turn_room(c), self.cfg.max_response_tokens - len(c.token_ids))

    def spec(self, max_new: int) -> SamplingSpec:
        s = self.sampling
        return SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=max_new,
                            stop=self.stops)

    def request(self, c: Conversation) -> GenerationRequest:
        """The next request: the prompt and every token so far; the seed of (sample seed, turn), or of (sample
        seed, turn, part) where a turn goes on past a bare opening fence."""
        seed = (turn_seed(c.start.seed, c.num_turns - 1, c.parts) if c.open_block
                else turn_seed(c.start.seed, c.num_turns))
        return GenerationRequest(c.start.prompt_token_ids + c.token_ids, seed)

    def record(self, c: Conversation, sample: Sample, max_new: int) -> None:
        """Append a finished request's tokens to its turn (a new one, or the open one it continues) and set the
        finish reason where the turn ends the conversation (in feedback mode the judge decides the rest,
        `apply_verdict`). In tool mode a stop at the code fence is a tool call only when the fence closes a
        block: a bare opening fence matches the stop string too, and then the same turn goes on."""
        cfg = self.cfg
        budget_bound = max_new < self.turn_room(c)  # the conversation's budget, not the turn's cap, set max_new
        begin = len(c.token_ids)
        c.token_ids += sample.token_ids
        c.logprobs += sample.logprobs
        c.loss_mask += [1] * len(sample.token_ids)
        if c.open_block:
            c.turn_spans[-1][1] = len(c.token_ids)
            c.parts += 1
        else:
            c.turn_spans.append([begin, len(c.token_ids)])
            c.messages.append({"role": "assistant", "content": ""})
            c.parts = 1
        begin_turn, end_turn = c.turn_spans[-1]
        text = self.tokenizer.decode(c.token_ids[begin_turn:end_turn], skip_special_tokens=True)
        c.messages[-1]["content"] = text
        out_of_budget = len(c.token_ids) >= cfg.max_response_tokens
        at_code_stop = (cfg.mode == "tool" and sample.finish_reason == "stop"
                        and sample.token_ids[-1:] != [] and sample.token_ids[-1] not in self.observe.special_ids
                        and self.code_stop in self.tokenizer.decode(sample.token_ids, skip_special_tokens=True))
        c.open_block = at_code_stop and cfg.code_format == "markdown" and ends_inside_block(text)
        c.turn_cut = sample.finish_reason == "length"
        if c.turn_cut and (budget_bound or out_of_budget):
            c.finish_reason = "budget"
        elif cfg.mode == "feedback":
            c.finish_reason = "budget" if out_of_budget else None  # the judge decides (apply_verdict)
        elif c.turn_cut:
            c.finish_reason = "length"
        elif c.open_block and (out_of_budget or self.turn_room(c) <= 0):
            c.open_block, c.turn_cut = False, True
            c.finish_reason = "budget" if out_of_budget else "length"
        elif c.open_block:
            c.finish_reason = None  # the same turn goes on
        elif not at_code_stop:
            c.finish_reason = "stop"
        elif c.tool_calls >= cfg.max_tool_calls:
            c.finish_reason = "max_tool_calls"
        elif c.num_turns == cfg.max_turns:
            c.finish_reason = "max_turns"
        elif out_of_budget:
            c.finish_reason = "budget"

    def calls(self, c: Conversation) -> list[ToolCall]:
        """The calls of a turn that ended at the code stop: its `<tool_call>`s (hermes, as many as the
        conversation's max_tool_calls still allows), or its last code block as a code_interpreter call."""
        text = c.messages[-1]["content"]
        if self.cfg.code_format == "hermes":
            return hermes_calls(text, self.tools or [])[:self.cfg.max_tool_calls - c.tool_calls]
        code = tool_code(text, self.cfg.code_format)
        if code is None:  # the closed block was empty, or tagged with another language
            return [ToolCall("", {}, "no code found in the block")]
        return [ToolCall(CODE_INTERPRETER, {"code": code})]

    def apply_tool_results(self, c: Conversation, calls: list[ToolCall], results: list[ToolResult]) -> None:
        """A turn's tool calls' outputs as the next observation, one `tool` message each."""
        c.tool_calls += len(calls)
        c.tool_errors += sum(int(result.error) for result in results)
        c.tool_seconds += sum(result.seconds for result in results)
        outputs = [result.output for result in results]
        tokens = self.observe.tool(c.start.messages, outputs, c.token_ids[-1] if c.token_ids else None)
        c.messages += [{"role": "tool", "content": output} for output in outputs]
        _append_observation(c, tokens, self.cfg)

    def apply_verdict(self, c: Conversation, verdict: tuple[float, bool, str]) -> None:
        """Feedback mode: keep the answer's reward; a failed one still within its limits gets the failures back."""
        reward, passed, message = verdict
        c.turn_rewards.append(float(reward))
        c.turn_passed.append(bool(passed))
        if c.finish_reason is not None:
            return
        if passed:
            c.finish_reason = "stop"
        elif c.num_turns == self.cfg.max_turns:
            c.finish_reason = "length" if c.turn_cut else "max_turns"
        else:
            tokens = self.observe.user(c.start.messages, message, c.token_ids[-1] if c.token_ids else None)
            c.messages.append({"role": "user", "content": message})
            _append_observation(c, tokens, self.cfg)


def _run_per_turn(backend: Backend, turns: TurnRules, conversations: list[Conversation], label: str,
                  tool: Toolbox | None, judge: Judge | None, figures: dict[str, float]) -> None:
    """One batched `generate` call per turn (per group sharing a token cap) for every conversation still going,
    then that turn's tool calls or judgements together: a turn waits for its slowest member."""
    for turn in range(turns.cfg.max_turns):
        active = [c for c in conversations if c.finish_reason is None]
        if not active:
            break
        going = active
        while going:  # a turn that stopped at a bare opening fence goes on in another call
            budgets: dict[int, list[Conversation]] = {}
            for c in going:
                budgets.setdefault(turns.max_new(c), []).append(c)
            for max_new, group in sorted(budgets.items()):
                result = generate_with_progress(backend, [turns.request(c) for c in group], turns.spec(max_new),
                                                f"{label} turn {turn + 1}")
                figures["generation_seconds"] += result.seconds
                figures["generated_tokens"] += result.tokens
                for c, sample in zip(group, result.samples, strict=True):
                    turns.record(c, sample, max_new)
            going = [c for c in going if c.open_block]
        started = time.monotonic()
        if turns.cfg.mode == "tool":
            calling = [c for c in active if c.finish_reason is None]
            calls = [turns.calls(c) for c in calling]
            results = tool.run_each(calls)  # type: ignore[union-attr]
            figures["tool_wall_seconds"] += time.monotonic() - started
            for c, turn_calls, turn_results in zip(calling, calls, results, strict=True):
                turns.apply_tool_results(c, turn_calls, turn_results)
        else:
            position = {id(c): i for i, c in enumerate(conversations)}
            verdicts = judge([position[id(c)] for c in active], [c.messages[-1]["content"] for c in active])  # type: ignore[misc]
            figures["judge_seconds"] += time.monotonic() - started
            for c, verdict in zip(active, verdicts, strict=True):
                turns.apply_verdict(c, verdict)


def _run_continuous(open_session: Callable[[], AbstractContextManager[TurnSession]], turns: TurnRules,
                    conversations: list[Conversation], label: str, tool: Toolbox | None, judge: Judge | None,
                    figures: dict[str, float]) -> None:
    """Continuous batching across turns: every conversation's turn 0 enters the engine at once; a finished turn's
    tool call (or judgement, one call per engine step's finished answers) runs in a thread pool while the engine
    keeps decoding the others, and the conversation's next turn is submitted as soon as it returns. The seconds
    the engine sat idle waiting for tool calls or the judge are counted apart (tool_wall_seconds, judge_seconds);
    the rest of the loop's wall time is generation_seconds."""
    waiting_key = "tool_wall_seconds" if turns.cfg.mode == "tool" else "judge_seconds"
    caps: dict[int, int] = {}
    waiting: dict[Future, tuple[list[int], list[list[ToolCall]]]] = {}
    threads = tool.threads if tool is not None else 4
    started = time.monotonic()
    with (open_session() as session, ThreadPoolExecutor(threads, thread_name_prefix="turn") as pool,
          progress_bar(label, len(conversations)) as progress):

        def submit_turn(key: int) -> None:
            c = conversations[key]
            caps[key] = turns.max_new(c)
            session.submit(key, turns.request(c), turns.spec(caps[key]))

        for key in range(len(conversations)):
            submit_turn(key)
        while session.running or waiting:
            if session.running:
                finished = session.step()
            else:  # nothing to decode: wait for a tool call or judgement to come back
                idle = time.monotonic()
                wait(list(waiting), return_when=FIRST_COMPLETED)
                figures[waiting_key] += time.monotonic() - idle
                finished = []
            judged: list[int] = []
            for key, sample in finished:
                c = conversations[key]
                turns.record(c, sample, caps[key])
                figures["generated_tokens"] += len(sample.token_ids)
                if c.open_block:  # stopped at a bare opening fence: the same turn goes on
                    submit_turn(key)
                elif turns.cfg.mode == "feedback":
                    judged.append(key)
                elif c.finish_reason is None:
                    calls = turns.calls(c)
                    waiting[pool.submit(lambda calls: [tool.run(calls)], calls)] = ([key], [calls])  # type: ignore[union-attr]
                else:
                    progress()
            if judged:
                texts = [conversations[key].messages[-1]["content"] for key in judged]
                waiting[pool.submit(judge, judged, texts)] = (judged, [[] for _ in judged])  # type: ignore[arg-type]
            for future in [f for f in waiting if f.done()]:
                keys, calls_of = waiting.pop(future)
                for key, calls, outcome in zip(keys, calls_of, future.result(), strict=True):
                    c = conversations[key]
                    if turns.cfg.mode == "tool":
                        turns.apply_tool_results(c, calls, outcome)
                    else:
                        turns.apply_verdict(c, outcome)
                    if c.finish_reason is None:
                        submit_turn(key)
                    else:
                        progress()
    figures["generation_seconds"] = time.monotonic() - started - figures[waiting_key]


def _append_observation(c: Conversation, tokens: list[int], cfg: MultiTurnConfig) -> None:
    """Observation tokens with loss_mask 0 and logprob 0.0, cut at the conversation's budget (then finished)."""
    room = cfg.max_response_tokens - len(c.token_ids)
    if len(tokens) >= room:
        tokens = tokens[:room]
        c.finish_reason = "budget"
    c.token_ids += tokens
    c.logprobs += [0.0] * len(tokens)
    c.loss_mask += [0] * len(tokens)
