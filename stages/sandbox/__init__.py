"""Score model responses in a sandbox: function tests, stdin/stdout cases and math answers.

Public API:

    with Sandbox.from_config(cfg.score) as sandbox:      # starts warm workers, logs the active layers
        results = sandbox.score([ScoreJob(response_text, reward_spec), ...], progress=callback)

Layout: extract.py (code/answer extraction), checks.py + judge.py (HumanEval checks judged outside the
candidate's process), _runner.py (what runs inside the sandbox), process.py (child processes under a
deadline), isolation.py (the layers), scoring.py (one job), worker.py + sandbox.py (the warm pool),
fusion.py (SandboxFusion client backend), server.py (our sandbox behind SandboxFusion's /run_code).
"""

from .extract import extract_answer, extract_code
from .jobs import ScoreJob, ScoreResult
from .sandbox import Sandbox, SandboxError

__all__ = ["Sandbox", "SandboxError", "ScoreJob", "ScoreResult", "extract_answer", "extract_code"]
