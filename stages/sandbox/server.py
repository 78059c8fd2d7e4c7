"""`rlpipe sandbox serve`: our local sandbox behind SandboxFusion's `POST /run_code` API.

Other trainers (verl, OpenRLHF, anything with a SandboxFusion client) can then run Python through this
sandbox's isolation: same request fields (code, stdin, language, run_timeout, compile_timeout, files as
base64, fetch_files) and the same response (status Success | Failed | SandboxError, message,
compile_result, run_result with status Finished | TimeLimitExceeded | Error, execution_time,
return_code, stdout, stderr; files). Python only; another language answers SandboxError.

It listens on 127.0.0.1 by default: the API runs arbitrary code on request, so exposing it beyond the
machine is a deliberate choice of `host`. Requests are served from FastAPI's thread pool and share the
sandbox's warm workers (Sandbox is thread-safe), so at most `cfg.workers` programs run at once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from schemas.config import ScoreConfig

from .sandbox import Sandbox


class RunCodeRequest(BaseModel):
    compile_timeout: float = Field(10, description="compile timeout for compiled languages (unused)")
    run_timeout: float = Field(10, description="code run timeout in seconds (at most 60 here)")
    code: str = Field(..., description="the code to run")
    stdin: str | None = Field(None, description="optional string to pass into stdin")
    language: str = Field(..., description="the language; only python is supported here")
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list, description="paths to return after the run")


class CommandRunResult(BaseModel):
    status: str
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: str
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def create_app(cfg: ScoreConfig, sandbox: Sandbox | None = None) -> FastAPI:
    """The ASGI app; starts its own sandbox for its lifetime unless one is given (tests share one)."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202 - FastAPI's lifespan protocol
        owned = sandbox is None
        state["sandbox"] = Sandbox(cfg).start() if owned else sandbox
        try:
            yield
        finally:
            if owned:
                state["sandbox"].close()

    app = FastAPI(title="rlpipe sandbox", lifespan=lifespan)

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(request: RunCodeRequest) -> dict:
        return await run_in_threadpool(state["sandbox"].run_code, request.model_dump())

    @app.get("/healthz")
    async def healthz() -> dict:
        current = state["sandbox"]
        return {"status": "ok", "isolation": current.isolation, "layers": current.layers}

    return app


def serve(cfg: ScoreConfig, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run the /run_code server until interrupted (the lead wires this to `rlpipe sandbox serve`)."""
    import uvicorn

    app = create_app(cfg.model_copy(update={"backend": "local"}))
    uvicorn.run(app, host=host, port=port, log_level="info")
