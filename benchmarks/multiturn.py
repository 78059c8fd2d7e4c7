"""What the multi-turn agent loop costs: model tokens/s of a multi-turn rollout batch (up to 4 turns) vs single-turn
generation of the same tokens, on the same engine in the same process, tool and judge time reported apart.

Batches: `--mode tool` (default): the shipped ReTool math prompts (deployments/data/retool-math.jsonl; `--direct`:
prompts that ask for a code block outright) x n samples, tool calls in the real sandbox (max_turns 4, max_tool_calls
3); SmolLM2-135M seldom calls the tool more than once, so this is mostly a 1-2 turn batch. `--mode feedback`: one
pytasks problem from each of the last `--prompts` families, the tests' failures fed back, up to 4 turns: the 135M
model fails nearly all of them, so nearly every conversation runs its 4 turns, a true multi-turn batch.

Loops, in the same run: `per_turn` (one batched generate call per turn, a turn waits for its slowest member) and,
where the backend has sessions (vLLM), `continuous` (continuous batching across turns: a conversation's next turn
enters the engine as soon as its tool call or judgement returns). A loop's rate is its model tokens over its wall
time less the seconds the engine sat idle waiting on tool calls or the judge (so the loop's own work, re-prefilling
each turn's growing prompt and encoding observations, counts against it).

Single-turn comparators, measured right after each loop (same requests, one engine session each): (1) **each
request generates exactly its own conversation's model-token count** (vLLM `ignore_eos`, per-request
max_tokens): the same length distribution, so a batch that drains as short requests finish drains here too,
and the ratio shows what the loop costs. This is the headline. (2) every request generates the batch's mean (a
perfectly full batch, the earlier comparator): the ratio then also charges the loop for the length
distribution, which single-turn generation of those lengths would pay too. The HF backend has no sessions:
comparator (2) only, capped at the mean, eos may end a request early. Rates are given by wall time and by this
process's CPU time (the engine runs in it on CPU; sandbox work is in other processes): on a shared machine
whose load changes between the loop and its comparator the CPU-time ratio is the steadier one.
`--repeat-continuous` runs the continuous loop twice; the run prints how many conversations came out token
for token the same, per-turn vs continuous and continuous vs continuous. Target: ratio >= 0.7.

Measured 2026-11-25 on the 2-core box, vLLM CPU fp32 eager (full figures and the loaded runs: docs/measurements.md):
- Tool mode, `--backend vllm --mode tool --direct --prompts 18 --samples 4 --turn-tokens 64 --repeat-continuous`,
  load 2.6 -> 2.0, the steadiest run (each comparator measured twice within 1-2%): 72 conversations, mean 1.65 turns,
  47 tool calls. Per-turn loop 154.8 tok/s, continuous 188.8 (repeat 185.5) tok/s; single-turn at each
  conversation's own length 248.8 / 243.3 tok/s: **ratio per-turn 0.62, continuous 0.78 (target >= 0.7 met)**, by
  CPU time the same; against the full batch at the mean 0.50 and 0.60. Tool time 0.16 s apart (per-turn; the
  continuous loop's engine never sat idle on a tool). Same tokens: 72/72 per-turn vs continuous, 72/72 continuous
  vs continuous.
- Feedback mode, `--mode feedback --prompts 6 --samples 4 --turn-tokens 48` (24 conversations, 22 ran all 4
  turns), load 1.4 -> 2.6: per-turn 86.4 tok/s, continuous 90.8 tok/s; against own lengths 0.65 and 0.45 (by CPU
  time 0.55, 0.54), the comparator moving 133 -> 202 tok/s between its two measurements. With nearly every
  conversation running all 4 turns the batch barely shrinks (24, 23, 22, 22), so continuous batching has little
  to win; the cost is the growing context (prompt, earlier answers, feedback tokens, which single-turn generation
  never prefills or attends to: per-turn rates 175, 130, 89, 45 tok/s). Same tokens 24/24.

Run: `.venv/bin/python -m benchmarks.multiturn --backend vllm --mode feedback` (`--help` for sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "deployments" / "data" / "retool-math.jsonl"
TEMPERATURE = 0.8


def tool_starts(args: argparse.Namespace) -> tuple[list[list[dict]], list[Any]]:
    """The ReTool math prompts (or `--direct` ones that ask for a code block outright): messages, specs."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines()][: args.prompts]
    texts = [row["prompt"] for row in rows]
    if args.direct:
        texts = [f"Use Python: print({a} * {b} + {i}). Write only the code block."
                 for i, (a, b) in enumerate(zip(range(17, 17 + len(rows)), range(31, 31 + len(rows)), strict=True))]
    return [[{"role": "user", "content": text}] for text in texts], [None] * len(texts)


def feedback_starts(args: argparse.Namespace) -> tuple[list[list[dict]], list[dict]]:
    """One pytasks problem from each of the last `--prompts` families (messages and code_tests specs)."""
    from stages.data.pytasks import generate_rows
    from stages.data.rows import code_messages, code_tests_spec

    rows = generate_rows()
    firsts = {}
    for row in rows:
        firsts.setdefault(row["family"], row)
    chosen = list(firsts.values())[-args.prompts:]
    return ([code_messages(row["prompt"]) for row in chosen],
            [code_tests_spec(row["prompt"], row["test"], row["entry_point"]) for row in chosen])


def single_turn(backend: Any, requests: list[Any], lengths: list[int]) -> tuple[int, float, float]:  # noqa: ANN401
    """(tokens, seconds, this process's CPU seconds) of single-turn generation where request i samples exactly
    lengths[i] tokens (a vLLM session with ignore_eos); without sessions, one batch capped at max(lengths)."""
    from stages.generation.base import SamplingSpec, sessions

    open_session = sessions(backend)
    started, cpu_started = time.monotonic(), time.process_time()
    if open_session is None:
        samples = backend.generate(requests, SamplingSpec(temperature=TEMPERATURE, max_new_tokens=max(lengths)))
        tokens = sum(len(s.token_ids) for s in samples)
        return tokens, time.monotonic() - started, time.process_time() - cpu_started
    tokens = 0
    with open_session() as session:
        for key, (request, length) in enumerate(zip(requests, lengths, strict=True)):
            session.submit(key, request, SamplingSpec(temperature=TEMPERATURE, max_new_tokens=length), ignore_eos=True)
        while session.running:
            tokens += sum(len(sample.token_ids) for _, sample in session.step())
    return tokens, time.monotonic() - started, time.process_time() - cpu_started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--mode", choices=["tool", "feedback"], default="tool")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--direct", action="store_true",
                        help="tool mode: prompts that ask for a code block outright (`Use Python: print(...)`)")
    parser.add_argument("--repeat-continuous", action="store_true",
                        help="run the continuous loop twice and count the conversations that came out the same")
    args = parser.parse_args()

    from schemas.config import GenerateConfig, ModelConfig, MultiTurnConfig, ScoreConfig
    from stages.generation import make_backend
    from stages.generation.agent_loop import ConversationStart, SandboxTool, run_conversations, sandbox_judge
    from stages.generation.base import GenerationRequest, SamplingSpec, sample_seed, sessions
    from stages.generation.models import load_tokenizer, resolve_model
    from stages.generation.sampling import encode_prompts
    from stages.sandbox import Sandbox
    from stages.sandbox.rewards import RewardInput

    model_dir = resolve_model(ModelConfig())
    tokenizer = load_tokenizer(model_dir)
    messages, specs = tool_starts(args) if args.mode == "tool" else feedback_starts(args)
    encoded = encode_prompts(tokenizer, [str(i) for i in range(len(messages))],
                             [json.dumps(m) for m in messages], 768, "skip")
    starts = [ConversationStart(messages[int(pid)], ids, sample_seed(0, 0, pid, s))
              for pid, ids in zip(encoded.prompt_ids, encoded.token_ids, strict=True) for s in range(args.samples)]
    owners = [int(pid) for pid in encoded.prompt_ids for _ in range(args.samples)]
    mt = MultiTurnConfig(mode=args.mode, max_turns=4, max_tool_calls=3, feedback_chars=256,
                         max_response_tokens=4 * args.turn_tokens + 3 * 128)
    gen = GenerateConfig(backend=args.backend, multi_turn=mt, max_new_tokens=args.turn_tokens)
    backend = make_backend(args.backend, model_dir, gen)
    sampling = SamplingSpec(temperature=TEMPERATURE, max_new_tokens=args.turn_tokens)
    score_cfg = ScoreConfig(workers=2)
    loops = ["per_turn", "continuous"] if sessions(backend) else ["per_turn"]
    if args.repeat_continuous and sessions(backend):
        loops.append("continuous")
    load_before = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    try:
        # One short call first, so no measurement pays the engine's first-call costs.
        backend.generate([GenerationRequest(starts[0].prompt_token_ids, 0)], SamplingSpec(max_new_tokens=8))
        requests = [GenerationRequest(s.prompt_token_ids, s.seed) for s in starts]
        with Sandbox.from_config(score_cfg) as sandbox:
            tool = SandboxTool(sandbox, mt.tool_timeout_s, 512) if args.mode == "tool" else None
            judge = (sandbox_judge(sandbox, score_cfg, [specs[i] for i in owners],
                                   [RewardInput(starts[k].messages, {}, "pytasks") for k in range(len(starts))],
                                   mt.feedback_chars, show_tests=True)  # as measured: every failing assert
                     if args.mode == "feedback" else None)
            for loop in loops:
                cfg = mt.model_copy(update={"continuous_batching": loop == "continuous"})
                started, cpu_started = time.monotonic(), time.process_time()
                conversations, figures = run_conversations(backend, tokenizer, cfg, starts, sampling, loop,
                                                           tool=tool, judge=judge)
                run = {"loop": loop, "conversations": conversations, "wall": time.monotonic() - started,
                       "cpu": time.process_time() - cpu_started,
                       "waited": figures["tool_wall_seconds"] + figures["judge_seconds"],
                       "tokens": sum(sum(c.loss_mask) for c in conversations)}
                runs.append(run)
                if len(runs) > 2:
                    continue  # the repeat is for the token comparison only
                # each loop's comparators right after it, so that the two see about the same load
                own = [max(1, sum(c.loss_mask)) for c in conversations]
                mean = [max(1, round(run["tokens"] / len(starts)))] * len(starts)
                # exact per-request lengths need ignore_eos: vLLM sessions only
                for kind, lengths in (("own", own), ("mean", mean)) if sessions(backend) else (("mean", mean),):
                    run[kind] = single_turn(backend, requests, lengths)
    finally:
        backend.close()
    report(backend.name, args, runs, load_before)


def report(backend: str, args: argparse.Namespace, runs: list[dict[str, Any]], load_before: float) -> None:
    first = runs[0]["conversations"]
    turns = sum(c.num_turns for c in first) / len(first)
    calls = sum(c.tool_calls for c in first)
    print(f"backend {backend}, mode {args.mode}; {len(first)} conversations; per-turn loop: mean {turns:.2f} turns, "
          f"{sum(c.num_turns == 4 for c in first)} reached 4 turns, {calls} tool calls")
    for i, run in enumerate(runs):
        rate = run["tokens"] / max(run["wall"] - run["waited"], 1e-9)
        cpu_rate = run["tokens"] / max(run["cpu"], 1e-9)
        label = run["loop"] + (" (repeat)" if i == 2 else "")
        print(f"{label}: {run['tokens']} model tokens in {run['wall']:.1f} s, engine idle on tools/judge "
              f"{run['waited']:.2f} s (apart): {rate:.1f} tok/s; {run['cpu']:.1f} CPU s: {cpu_rate:.1f} tok/CPU-s")
        for kind, what in (("own", "each request its conversation's model tokens"),
                           ("mean", "every request the mean, a full batch")):
            if kind in run:
                tokens, seconds, cpu = run[kind]
                print(f"  single-turn, {what}: {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tok/s, "
                      f"{tokens / cpu:.1f} tok/CPU-s; ratio {rate / (tokens / seconds):.2f} "
                      f"(by CPU time {cpu_rate / (tokens / cpu):.2f})")
    if len(runs) > 1:
        same = sum(a.token_ids == b.token_ids for a, b in zip(first, runs[1]["conversations"], strict=True))
        print(f"same tokens, per-turn vs continuous: {same}/{len(first)} conversations")
    if len(runs) > 2:
        same = sum(a.token_ids == b.token_ids
                   for a, b in zip(runs[1]["conversations"], runs[2]["conversations"], strict=True))
        print(f"same tokens, continuous vs continuous: {same}/{len(first)} conversations")
    print(f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f} (target: ratio >= 0.7, tool time excluded)")


if __name__ == "__main__":
    main()
