"""An environment's server inside the job's sandbox, reached from the run worker: started in the
background by the sandbox's bash, listening on a Unix socket in the sandbox's /tmp (the sandbox
has no network; its /tmp is a host folder), its log beside it. The socket lives where the sandbox
can write, so the worker never follows a path to it: the folder and the socket are opened without
following symlinks and connected through ``/proc/self/fd``, so a link planted there cannot point
the worker at a host socket. A server that does not come up is the environment's fault (failure
'task'), said with its log. OpenEnv (openenv_session.py) and NeMo Gym (nemo_gym_env.py) use it."""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import stat
import time
from collections.abc import Awaitable, Callable

from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.errors import SandboxError
from rollstream.sandboxes.sandbox_client import SandboxClient

log = logging.getLogger(__name__)

SOCKET_NAME = "server.sock"
LOG_NAME = "server.log"
LOG_TAIL_BYTES = 3000
SESSION = "rs-env-server"  # the bash session the server is started from
ALIVE_CHECK_S = 2.0


class EnvironmentBroken(JobFailed):
    """The environment's server failed (did not start, died, answered what its protocol never sends)."""

    def __init__(self, message: str):
        super().__init__(message, retryable=False, failure="task")


class SandboxServer:
    """One server in the job's sandbox, in its folder ``/tmp/<folder>``."""

    def __init__(self, sandbox: SandboxClient, folder: str, what: str) -> None:
        self.sandbox = sandbox
        self.inner_dir = f"/tmp/{folder}"
        self.what = what  # names the environment in errors
        self._host_dir = os.path.join(SandboxLayout(os.path.dirname(sandbox.socket_path)).tmp, folder)
        self._fd: int | None = None

    @property
    def inner_socket(self) -> str:
        return f"{self.inner_dir}/{SOCKET_NAME}"

    async def start(self, workdir: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        """Run ``argv`` in ``workdir`` in the background (its own session, no terminal)."""
        q = shlex.quote
        assignments = " ".join(f"{key}={q(value)}" for key, value in (env or {}).items())
        command = (f"mkdir -p {self.inner_dir} && cd {q(workdir)} && ({assignments} setsid "
                   f"{' '.join(q(a) for a in argv)} > {self.inner_dir}/{LOG_NAME} 2>&1 < /dev/null &)")
        await self.sandbox.bash(command, timeout_s=60, session=SESSION)

    def socket_path(self) -> str | None:
        """``/proc/self/fd/N`` of the socket once it exists; None while it does not."""
        if self._fd is not None:
            return f"/proc/self/fd/{self._fd}"
        flags = os.O_PATH | os.O_NOFOLLOW
        try:
            folder = os.open(self._host_dir, flags | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        except NotADirectoryError:  # a link (never followed) or a file in its place
            raise EnvironmentBroken(f"{self.what}: its server's folder {self.inner_dir} is not a folder") from None
        try:
            fd = os.open(SOCKET_NAME, flags, dir_fd=folder)
        except FileNotFoundError:
            return None
        finally:
            os.close(folder)
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.close(fd)
            raise EnvironmentBroken(f"{self.what}: its server's socket {self.inner_socket} is not a socket")
        self._fd = fd
        return f"/proc/self/fd/{fd}"

    async def wait_ready(self, ready: Callable[[str], Awaitable[bool]], timeout_s: float) -> str:
        """The socket's path once ``ready(path)`` says the server answers; EnvironmentBroken with
        its log past ``timeout_s``."""
        started = time.monotonic()
        checked = started
        while True:
            path = self.socket_path()
            if path is not None and await ready(path):
                return path
            now = time.monotonic()
            if now - started > timeout_s:
                raise EnvironmentBroken(f"{self.what}: its server did not answer within {timeout_s:.0f} s; its log: "
                                        f"{await self.log_tail()}")
            if now - checked > ALIVE_CHECK_S:  # one that died at start (an import error) fails now, not at the limit
                checked = now
                if not await self.running():
                    raise EnvironmentBroken(f"{self.what}: its server exited before it answered; its log: "
                                            f"{await self.log_tail()}")
            await asyncio.sleep(0.2)

    async def running(self) -> bool:
        result = await self.sandbox.bash(f"pgrep -f -- {shlex.quote(self.inner_socket)} > /dev/null", timeout_s=30,
                                         session=SESSION)
        return result.exit_code == 0

    async def log_tail(self) -> str:
        try:
            text = (await self.sandbox.read_file(f"{self.inner_dir}/{LOG_NAME}")).decode("utf-8", "replace")
        except (SandboxError, OSError) as error:  # the log is for the message; its absence is said, not raised
            return f"(no log: {error})"
        return text[-LOG_TAIL_BYTES:].strip() or "(empty)"

    async def stop(self) -> None:
        """Stop the server (the sandbox goes with the job anyway) and let go of its socket."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            await self.sandbox.bash(f"pkill -f -- {shlex.quote(self.inner_socket)} || true", timeout_s=30,
                                    session=SESSION)
        except (SandboxError, OSError):  # the sandbox may be gone already: teardown frees it regardless
            log.debug("stopping the server of %s failed", self.what, exc_info=True)
