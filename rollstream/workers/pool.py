"""Starting and stopping worker processes from one command (``rollstream up``, the demo,
tests, benchmarks): each is ``python -m rollstream worker STAGE`` with the same settings."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from rollstream.errors import RollstreamError
from rollstream.messages import STAGES


class WorkerProcessExited(RollstreamError):
    """A worker process of a pool exited while the pool should be serving, or did not register in time."""


@dataclass
class WorkerPool:
    redis_url: str
    namespace: str = "rs"
    node: str | None = None
    data_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    # What serves a stage: run as PROGRAM STAGE --concurrency N. Benchmarks that register a
    # task of their own in the worker process pass their own entry point.
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "rollstream", "worker"])
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.env, "REDIS_URL": self.redis_url, "ROLLSTREAM_NAMESPACE": self.namespace}
        if self.node:
            env["ROLLSTREAM_NODE"] = self.node
        if self.data_dir:
            env["ROLLSTREAM_DATA_DIR"] = str(self.data_dir)
        return env

    def start(self, stage: str, *, processes: int = 1, concurrency: int = 64) -> list[subprocess.Popen]:
        started = []
        for _ in range(processes):
            out: int | IO[bytes] = subprocess.DEVNULL
            if self.log_dir:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{stage}-{len(self.procs)}.log", "ab")  # noqa: SIM115 - closed below
            proc = subprocess.Popen([*self.program, stage, "--concurrency", str(concurrency)],
                                    env=self._env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if not isinstance(out, int):
                out.close()
            self.procs.append((stage, proc))
            started.append(proc)
        return started

    def start_all(self, *, processes: int = 1, concurrency: int = 64) -> None:
        for stage in STAGES:
            self.start(stage, processes=processes, concurrency=concurrency)

    def alive(self) -> list[tuple[str, subprocess.Popen]]:
        return [(s, p) for s, p in self.procs if p.poll() is None]

    def _log_tail(self, index: int, stage: str, chars: int = 3000) -> str:
        if not self.log_dir:
            return "(no log_dir was given: the process's output went nowhere)"
        path = self.log_dir / f"{stage}-{index}.log"
        try:
            return path.read_text(errors="replace")[-chars:] or f"({path} is empty)"
        except OSError as exc:
            return f"({path}: {exc})"

    def check_alive(self) -> None:
        """Raises WorkerProcessExited, with the end of its log, for the first process that exited
        (a pool is started to run until stopped: an exit is a failure, whenever it comes)."""
        for index, (stage, proc) in enumerate(self.procs):
            if proc.poll() is not None:
                argv = " ".join(cast(list[str], proc.args))
                raise WorkerProcessExited(
                    f"the {stage} worker (pid {proc.pid}, {argv}) exited with {proc.returncode}; "
                    f"the end of its output:\n{self._log_tail(index, stage)}")

    async def wait_registered(self, redis_client, workers_key: str, count: int, *, timeout_s: float = 120.0) -> None:
        """Waits until ``count`` workers heart-beat in ``workers_key`` (a ZSET), failing at once with
        the process's own output when one exits, and with every log after ``timeout_s``: a
        benchmark or a test never waits in silence for a pool that cannot start."""
        deadline = time.monotonic() + timeout_s
        while await redis_client.zcard(workers_key) < count:
            self.check_alive()
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {stage}-{i}:\n{self._log_tail(i, stage, 800)}"
                                  for i, (stage, _p) in enumerate(self.procs))
                raise WorkerProcessExited(f"{count} workers did not register within {timeout_s:.0f} s "
                                        f"({await redis_client.zcard(workers_key)} did); their output:\n{logs}")
            await asyncio.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> None:
        for _stage, proc in self.alive():
            proc.send_signal(signal.SIGTERM)
        for _stage, proc in self.procs:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
