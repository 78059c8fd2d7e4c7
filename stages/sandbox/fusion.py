"""Backend `sandbox_fusion`: score through a SandboxFusion service's `POST /run_code`.

For users who already run SandboxFusion (or `rlpipe sandbox serve`, the same API). Requests go out on a
bounded thread pool and are retried with exponential backoff on connection and HTTP errors and `SandboxError`
answers. `code_stdio`: one request per case; it passes on exit code 0 and stdout equal after trailing
whitespace. `code_tests`: one request per sample running preamble, candidate, test module and a harness that
prints a nonce-tagged line per passing test and a final `done` line (nothing counts without it, so an early
`sys.exit(0)` earns nothing). The harness shares the candidate's process, so a candidate that reads the
nonce could forge lines; the local backend's judge (judge.py) has no such weakness: use it when the reward
must resist hacking. `code_call`: the same, its check generated from the cases. `math`: compared here with
math-verify, as the local backend does.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from types import TracebackType

import httpx

from schemas.config import ScoreConfig

from .checks import CheckPlan, CheckSpecError, call_program, plan_calls, plan_checks
from .extract import extract_code
from .jobs import ScoreJob, ScoreResult
from .judge import TestOutcome, summarize
from .scoring import make_result, normalize_output, score_math

log = logging.getLogger("rlpipe.sandbox")


class FusionError(RuntimeError):
    """The service could not run the request after every retry."""


class FusionSandbox:
    """Same interface as the local Sandbox: a context manager with `score(jobs, progress)`."""

    isolation = "sandbox_fusion"

    def __init__(self, cfg: ScoreConfig, transport: httpx.BaseTransport | None = None) -> None:
        self.cfg = cfg
        self.url = cfg.sandbox_fusion_url.rstrip("/") + "/run_code"
        self._transport = transport
        self._client: httpx.Client | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def layers(self) -> dict[str, str]:
        return {"remote": f"SandboxFusion at {self.cfg.sandbox_fusion_url} (its own isolation)"}

    def start(self) -> FusionSandbox:
        limits = httpx.Limits(max_connections=self.cfg.sandbox_fusion_concurrency)
        self._client = httpx.Client(transport=self._transport, limits=limits, timeout=None)
        self._executor = ThreadPoolExecutor(self.cfg.sandbox_fusion_concurrency, thread_name_prefix="fusion")
        log.warning(
            "sandbox: backend sandbox_fusion at %s; isolation is the service's; function tests are judged "
            "inside the service's process (not hack-resistant, see stages/sandbox/fusion.py)",
            self.url,
        )
        return self

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> FusionSandbox:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------------------
    def run_code(self, request: dict) -> dict:
        """POST /run_code with retries; the service's JSON answer, or FusionError."""
        assert self._client is not None, "use the sandbox as a context manager"
        timeout = float(request.get("run_timeout") or self.cfg.timeout_s) + 30.0
        last = "no attempt"
        for attempt in range(self.cfg.sandbox_fusion_retries + 1):
            if attempt:
                time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
            try:
                response = self._client.post(self.url, json=request, timeout=timeout)
                if response.status_code >= 500 or response.status_code == 429:
                    last = f"HTTP {response.status_code}"
                    continue
                response.raise_for_status()
                body = response.json()
            except (httpx.HTTPError, ValueError) as error:
                last = f"{type(error).__name__}: {error}"
                continue
            if body.get("status") == "SandboxError":
                last = f"SandboxError: {body.get('message', '')[:300]}"
                continue
            return body
        raise FusionError(f"{self.url} failed after {self.cfg.sandbox_fusion_retries + 1} attempts: {last}")

    # -- scoring -------------------------------------------------------------------------------------
    def score(
        self, jobs: Iterable[ScoreJob], progress: Callable[[int], None] | None = None
    ) -> list[ScoreResult]:
        assert self._executor is not None, "use the sandbox as a context manager"
        futures = [self._executor.submit(self._score_one, job) for job in jobs]
        for _ in as_completed(futures):
            if progress is not None:
                progress(1)
        return [future.result() for future in futures]

    def _score_one(self, job: ScoreJob) -> ScoreResult:
        started = time.monotonic()
        spec = job.reward_spec or {}
        kind = spec.get("kind")
        try:
            if kind == "math":
                result = score_math(job.response_text, spec, self.cfg, started)
            elif kind == "code_stdio":
                result = self._stdio(extract_code(job.response_text), spec, started)
            elif kind == "code_tests":
                result = self._tests(extract_code(job.response_text), spec, started)
            elif kind == "code_call":
                result = self._calls(extract_code(job.response_text), spec, started)
            else:
                outcome = TestOutcome("reward_spec", "error", f"unknown kind {kind!r}")
                result = make_result(self.cfg, "error", [outcome], None, started)
        except FusionError as error:
            outcome = TestOutcome("sandbox_fusion", "error", str(error))
            result = make_result(self.cfg, "error", [outcome], extract_code(job.response_text), started)
        return ScoreResult.from_dict(result)

    def _stdio(self, code: str | None, spec: dict, started: float) -> dict:
        inputs, outputs = list(spec.get("inputs") or []), list(spec.get("outputs") or [])
        names = [f"case {index}" for index in range(len(inputs))]
        if code is None:
            outcomes = [TestOutcome(name, "fail", "no code block") for name in names]
            return make_result(self.cfg, "no_code", outcomes, None, started)
        outcomes = []
        for name, stdin, expected in zip(names, inputs, outputs, strict=True):
            body = self.run_code(
                {"code": code, "stdin": str(stdin), "language": "python", "run_timeout": self.cfg.timeout_s}
            )
            outcomes.append(_case_outcome(name, body, str(expected)))
        _, _, status = summarize(outcomes)
        return make_result(self.cfg, status, outcomes, code, started)

    def _tests(self, code: str | None, spec: dict, started: float) -> dict:
        preamble = spec.get("preamble") or ""
        try:
            plan = plan_checks(preamble, spec.get("test") or "")
        except CheckSpecError as error:
            return make_result(self.cfg, "error", [TestOutcome("check", "error", str(error))], code, started)
        test, entry_point = spec.get("test") or "", spec.get("entry_point") or ""
        return self._run_plan(code, code, preamble, test, entry_point, plan, started)

    def _calls(self, code: str | None, spec: dict, started: float) -> dict:
        fn_name = spec.get("fn_name") or ""
        try:
            test, plan = plan_calls(fn_name, spec.get("inputs"), spec.get("outputs"))
        except CheckSpecError as error:
            return make_result(self.cfg, "error", [TestOutcome("cases", "error", str(error))], code, started)
        program_code = call_program(code, fn_name) if code is not None else None
        return self._run_plan(code, program_code, "", test, fn_name, plan, started)

    def _run_plan(
        self, code: str | None, program_code: str | None, preamble: str, test: str, entry_point: str,
        plan: CheckPlan, started: float,
    ) -> dict:
        if code is None or program_code is None:
            outcomes = [TestOutcome(name, "fail", "no code block") for name in plan.test_names]
            return make_result(self.cfg, "no_code", outcomes, None, started)
        nonce = secrets.token_hex(16)
        program = harness_program(preamble, program_code, test, entry_point, plan, nonce)
        body = self.run_code(
            {"code": program, "stdin": "", "language": "python", "run_timeout": self.cfg.timeout_s}
        )
        outcomes = parse_harness_output(plan, body, nonce)
        _, _, status = summarize(outcomes)
        return make_result(self.cfg, status, outcomes, code, started)


def _case_outcome(name: str, body: dict, expected: str) -> TestOutcome:
    run = body.get("run_result") or {}
    if run.get("status") == "TimeLimitExceeded":
        return TestOutcome(name, "timeout", "time limit exceeded")
    if run.get("return_code") != 0:
        tail = (run.get("stderr") or "").strip().splitlines()[-1:] or [""]
        return TestOutcome(name, "error", f"exit code {run.get('return_code')}: {tail[0][:300]}")
    stdout = run.get("stdout") or ""
    if normalize_output(stdout) == normalize_output(expected):
        return TestOutcome(name, "ok")
    return TestOutcome(name, "fail", f"expected {expected[:100]!r}, got {stdout[:100]!r}")


def harness_program(
    preamble: str, code: str, test: str, entry_point: str, plan: CheckPlan, nonce: str
) -> str:
    """The self-judging program sent to the service (see the module docstring for what it can't stop)."""
    steps = [(step.source, step.name is not None) for step in plan.steps]
    return "\n".join(
        [
            preamble,
            code,
            test,
            "def __rlpipe_harness():",
            "    import sys",
            "    namespace = globals()",
            f"    namespace[{plan.parameter!r}] = namespace[{entry_point!r}]",
            f"    for index, (source, is_test) in enumerate({steps!r}):",
            "        try:",
            "            exec(compile(source, '<test>', 'exec'), namespace)",
            "            verdict = 'ok'",
            "        except BaseException as error:",
            "            verdict = 'fail ' + type(error).__name__",
            "        if is_test:",
            f"            sys.stdout.write({nonce!r} + ' ' + str(index) + ' ' + verdict + '\\n')",
            "            sys.stdout.flush()",
            f"    sys.stdout.write({nonce!r} + ' done\\n')",
            "__rlpipe_harness()",
        ]
    )


def parse_harness_output(plan: CheckPlan, body: dict, nonce: str) -> list[TestOutcome]:
    run = body.get("run_result") or {}
    verdicts: dict[int, str] = {}
    done = False
    for line in (run.get("stdout") or "").splitlines():
        if not line.startswith(nonce + " "):
            continue
        rest = line[len(nonce) + 1 :]
        if rest == "done":
            done = True
            continue
        index, _, verdict = rest.partition(" ")
        if index.isdigit():
            verdicts.setdefault(int(index), verdict)
    timed_out = run.get("status") == "TimeLimitExceeded"
    outcomes = []
    for index, step in enumerate(plan.steps):
        if step.name is None:
            continue
        verdict = verdicts.get(index)
        if not done:
            status = "timeout" if timed_out else "error"
            outcomes.append(TestOutcome(step.name, status, "the test program did not run to the end"))
        elif verdict == "ok":
            outcomes.append(TestOutcome(step.name, "ok"))
        else:
            outcomes.append(TestOutcome(step.name, "fail", verdict or "no result"))
    return outcomes
