"""Starting and stopping worker processes from one command (``rollstream up``, the demo,
tests, benchmarks): each is ``python -m rollstream worker STAGE`` with the same settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


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
        for i in range(processes):
            out = subprocess.DEVNULL
            if self.log_dir:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                out = open(self.log_dir / f"{stage}-{len(self.procs)}.log", "ab")
            proc = subprocess.Popen([*self.program, stage, "--concurrency", str(concurrency)],
                                    env=self._env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if out is not subprocess.DEVNULL:
                out.close()
            self.procs.append((stage, proc))
            started.append(proc)
        return started

    def start_all(self, *, processes: int = 1, concurrency: int = 64) -> None:
        for stage in ("init", "run", "eval"):
            self.start(stage, processes=processes, concurrency=concurrency)

    def alive(self) -> list[tuple[str, subprocess.Popen]]:
        return [(s, p) for s, p in self.procs if p.poll() is None]

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

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
