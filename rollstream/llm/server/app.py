"""HTTP face of the built-in server (FastAPI): vLLM's /v1/completions, /v1/models and /health,
plus /v1/load_weights, /v1/weights_placement and /v1/policy_version for the trainer's weight sync. Also the helpers
that run it: `serve_model` (blocking) and `start_server_process` (a child process, for tests)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rollstream.llm.server.completions import completion_response, stream_chunks, to_samples
from rollstream.llm.server.engine import ContextTooLong, Engine, EngineConfig, EngineError, next_request_id
from rollstream.llm.server.protocol import (
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    LoadWeightsRequest,
    ModelCard,
    ModelList,
    PolicyVersion,
    WeightsPlacement,
)
from rollstream.llm.server.registration import Registration, advertise_url_for
from rollstream.llm.weights_transfer import placement

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=kind, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(engine: Engine, registration: Registration | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        if registration is not None:
            await registration.register()
        yield
        if registration is not None:
            await registration.deregister()
        engine.shutdown()

    app = FastAPI(title="rollstream built-in model server", version="1", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, f"invalid request: {exc.errors()}")

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _error(400, str(exc))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=engine.model_name, root=str(engine.config.model_dir), max_model_len=engine.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=CompletionResponse, responses={400: {"model": ErrorResponse}})
    async def completions(body: CompletionRequest, request: Request):
        if body.model is not None and body.model != engine.model_name:
            return _error(
                404,
                f"The model `{body.model}` does not exist; this server serves `{engine.model_name}`",
                "NotFoundError",
            )
        samples = to_samples(engine, body)
        for sample in samples:
            engine.validate(sample.request)
        if body.stream:
            return StreamingResponse(
                stream_chunks(engine, body, next_request_id(), samples), media_type="text/event-stream"
            )
        tasks = [asyncio.ensure_future(engine.generate(s.request)) for s in samples]
        everything = asyncio.gather(*tasks)
        # A client that gave up (timeout, cancelled job) frees its batch slots at once, as
        # vLLM aborts a request whose connection closed.
        while not everything.done():
            await asyncio.wait({everything}, timeout=DISCONNECT_POLL_S)
            if not everything.done() and await request.is_disconnected():
                for task in tasks:
                    task.cancel()
                return Response(status_code=499)
        try:
            results = everything.result()
        except ContextTooLong as exc:
            return _error(400, str(exc))
        return completion_response(engine, body, next_request_id(), samples, results)

    @app.post("/v1/load_weights", response_model=PolicyVersion, responses={400: {"model": ErrorResponse}})
    async def load_weights(body: LoadWeightsRequest) -> PolicyVersion:
        source: str | dict = body.path if body.path is not None else (body.cuda_ipc or {})
        version = await engine.load_weights(source, body.policy_version)
        return PolicyVersion(policy_version=version)

    @app.get("/v1/weights_placement", response_model=WeightsPlacement)
    async def weights_placement() -> WeightsPlacement:
        return WeightsPlacement(**placement(engine.device).as_dict())

    @app.get("/v1/policy_version", response_model=PolicyVersion)
    async def policy_version() -> PolicyVersion:
        return PolicyVersion(policy_version=engine.policy_version)

    @app.get("/v1/engine_stats")
    async def engine_stats() -> dict:
        return engine.stats()

    return app


def serve_model(
    model_dir: Path | str,
    host: str = "127.0.0.1",
    port: int = 8000,
    device: str = "auto",
    max_batch_size: int = 64,
    max_model_len: int | None = None,
    served_model_name: str | None = None,
    prefix_cache_bytes: int = 1 << 30,
    logprobs_mode: str = "raw_logprobs",
    log_level: str = "warning",
    register_redis_url: str | None = None,
    namespace: str = "rs",
    advertise_url: str | None = None,
) -> None:
    """Load the model and serve it until interrupted (blocking). With `register_redis_url`,
    the server adds itself to the balancer once it serves and removes itself on exit."""
    import uvicorn

    config = EngineConfig(
        model_dir=Path(model_dir),
        device=device,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len,
        served_model_name=served_model_name,
        prefix_cache_bytes=prefix_cache_bytes,
        logprobs_mode=logprobs_mode,  # type: ignore[arg-type]
    )
    engine = Engine(config)
    registration = None
    if register_redis_url:
        registration = Registration(
            redis_url=register_redis_url,
            advertise_url=advertise_url or advertise_url_for(host, port),
            namespace=namespace,
            info={"model": engine.model_name},
        )
    # The model and the modules loaded to serve it live until the process exits: out of the cyclic
    # collector's sight, so that neither its full collections nor the exit walk them (0.7 s of CPU
    # at each server's exit on two loaded cores).
    gc.freeze()
    uvicorn.run(create_app(engine, registration), host=host, port=port, log_level=log_level)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server_process(
    model_dir: Path | str,
    port: int | None = None,
    host: str = "127.0.0.1",
    device: str = "cpu",
    extra_args: list[str] | None = None,
    startup_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start the server (`rollstream serve-model`, as `python -m rollstream.cli.llm`) in a child
    process and wait until /health answers; returns (process, base_url). The caller terminates it."""
    import httpx

    port = port or free_port(host)
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the server writes it for its whole life, past this call
        prefix="rollstream-model-server-", suffix=".log", delete=False
    )
    cmd = [
        sys.executable,
        "-m",
        "rollstream.cli.llm",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        *(extra_args or []),
    ]
    env = {**os.environ, **(env or {})}
    # Two server processes on a small machine must not each spawn a thread per core.
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://{host}:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log.name).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"model server exited with {proc.returncode} before serving; log {log.name}:\n{tail}")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"model server did not answer /health within {startup_timeout_s}s; log {log.name}")


@contextlib.contextmanager
def served_model(model_dir: Path | str, **kwargs):
    """``with served_model(dir) as base_url:`` a built-in server process for the block
    (start_server_process's arguments), terminated after it."""
    proc, base_url = start_server_process(model_dir, **kwargs)
    try:
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
