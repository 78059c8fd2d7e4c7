"""`rlpipe sandbox serve` (our sandbox behind SandboxFusion's /run_code) and the sandbox_fusion client
backend, talking real HTTP on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import uvicorn

from schemas.config import ScoreConfig
from stages.sandbox import Sandbox, ScoreJob
from stages.sandbox.server import create_app
from tests.support.ports import free_port

TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
SPEC = {"kind": "code_tests", "entry_point": "add", "preamble": "", "test": TEST}


@pytest.fixture(scope="module")
def server_url(sandbox: Sandbox, sandbox_config: ScoreConfig) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(sandbox_config, sandbox), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def post(url: str, **body: object) -> dict:
    response = httpx.post(url + "/run_code", json={"language": "python", **body}, timeout=30)
    assert response.status_code == 200
    return response.json()


def test_run_code_success_with_stdin_and_files(server_url: str):
    code = (
        "import sys\ndata = open('in.txt').read()\nopen('out/r.txt', 'w').write(data * 2)\n"
        "print(sum(map(int, sys.stdin.read().split())))"
    )
    body = post(
        server_url,
        code="import os\nos.makedirs('out', exist_ok=True)\n" + code,
        stdin="1 2 3",
        files={"in.txt": base64.b64encode(b"ab").decode()},
        fetch_files=["out/r.txt", "missing.txt"],
    )
    assert body["status"] == "Success"
    assert body["message"] == ""
    assert body["compile_result"] is None
    run = body["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "6\n", "")
    assert 0 < run["execution_time"] < 5
    assert body["files"] == {"out/r.txt": base64.b64encode(b"abab").decode()}


def test_run_code_failures(server_url: str):
    failed = post(server_url, code="raise SystemExit(4)")
    assert (failed["status"], failed["run_result"]["return_code"]) == ("Failed", 4)
    slow = post(server_url, code="while True:\n    pass", run_timeout=1)
    assert (slow["status"], slow["run_result"]["status"], slow["run_result"]["return_code"]) == (
        "Failed",
        "TimeLimitExceeded",
        None,
    )
    assert 1.0 <= slow["run_result"]["execution_time"] < 3
    other = post(server_url, code="console.log(1)", language="nodejs")
    assert other["status"] == "SandboxError"
    escape = post(server_url, code="print(1)", files={"../x": ""})
    assert escape["status"] == "SandboxError"
    assert "relative" in escape["message"]


def test_healthz_reports_isolation(server_url: str, sandbox: Sandbox):
    body = httpx.get(server_url + "/healthz").json()
    assert body == {"status": "ok", "isolation": sandbox.isolation, "layers": sandbox.layers}


def test_fusion_backend_against_our_server(server_url: str):
    cfg = ScoreConfig(backend="sandbox_fusion", sandbox_fusion_url=server_url, timeout_s=2.0)
    jobs = [
        ScoreJob("```python\ndef add(a, b):\n    return a + b\n```", SPEC),
        ScoreJob("```python\ndef add(a, b):\n    return a * b\n```", SPEC),
        ScoreJob("```python\nimport os\nos._exit(0)\n```", SPEC),
        ScoreJob("no code", SPEC),
        ScoreJob(
            "```python\nprint(int(input()) * 2)\n```",
            {"kind": "code_stdio", "inputs": ["2\n", "3\n"], "outputs": ["4", "7"]},
        ),
        ScoreJob(r"\boxed{42}", {"kind": "math", "answer": "42"}),
    ]
    calls: list[int] = []
    with Sandbox.from_config(cfg) as fusion:
        results = fusion.score(jobs, progress=calls.append)
    assert [(r.status, r.passed, r.total) for r in results] == [
        ("ok", 2, 2),
        ("fail", 1, 2),
        ("error", 0, 2),  # exited before the harness printed `done`: nothing counts
        ("no_code", 0, 2),
        ("fail", 1, 2),
        ("ok", 1, 1),
    ]
    assert [r.reward for r in results] == [1.0, 0.5, 0.0, 0.0, 0.5, 1.0]
    assert sum(calls) == len(jobs)


class _Flaky(BaseHTTPRequestHandler):
    """A real service fault: the first `failures` requests get HTTP 503, the rest a valid answer."""

    failures = 2
    seen: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if len(type(self).seen) <= type(self).failures:
            self.send_response(503)
            self.end_headers()
            return
        answer = {
            "status": "Success",
            "message": "",
            "run_result": {
                "status": "Finished",
                "return_code": 0,
                "stdout": "3\n",
                "stderr": "",
                "execution_time": 0.01,
            },
        }
        payload = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("retries", "status"), [(2, "ok"), (1, "error")])
def test_fusion_retries_service_errors(retries: int, status: str):
    _Flaky.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cfg = ScoreConfig(backend="sandbox_fusion", sandbox_fusion_url=url, sandbox_fusion_retries=retries)
    spec = {"kind": "code_stdio", "inputs": ["1 2\n"], "outputs": ["3\n"]}
    try:
        with Sandbox.from_config(cfg) as fusion:
            (result,) = fusion.score([ScoreJob("```python\nprint(3)\n```", spec)])
    finally:
        server.shutdown()
    assert result.status == status
    assert len(_Flaky.seen) == retries + 1
    assert _Flaky.seen[0] == {
        "code": "print(3)\n",
        "stdin": "1 2\n",
        "language": "python",
        "run_timeout": 5.0,
    }
    if status == "error":
        assert "HTTP 503" in result.tests[0]["message"]
