"""Starting supervisors: through the node's fork server (runtime/forkserver.py), or directly.

create_sandbox calls `spawn_supervisor`; it asks the fork server of the sandbox root to fork
a supervisor (a few ms instead of a Python start) and starts that server, detached, when
none answers — the first time, or after it was killed. `spawn_direct` is the fallback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import msgpack
import ptyprocess

from .reaper import pid_alive, register_child
from .roots import ensure_root
from .runtime import protocol
from .runtime.forkserver import PID_NAME, SOCKET_NAME
from .runtime.unix_path import open_unix_connection

log = logging.getLogger(__name__)

_RUNTIME = os.path.join(os.path.dirname(__file__), "runtime")
SUPERVISOR_SCRIPT = os.path.join(_RUNTIME, "supervisor.py")
FORKSERVER_SCRIPT = os.path.join(_RUNTIME, "forkserver.py")
# Runtime processes start with -S (no site) and find msgpack, ptyprocess and, when the
# kernel is first used, jupyter_client through this path instead.
_RUNTIME_PYTHONPATH = os.pathsep.join(
    dict.fromkeys(os.path.dirname(os.path.dirname(module.__file__)) for module in (msgpack, ptyprocess))
)
_START_TIMEOUT_S = 30.0


class ForkServerUnavailable(RuntimeError):
    """The fork server could not be started or reached; the caller may spawn directly."""


def runtime_env() -> dict[str, str]:
    """Environment of supervisors and the fork server (tools get the plan's filtered env)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_RUNTIME_PYTHONPATH, *sys.path[1:]]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def socket_path(root_dir: str) -> str:
    return os.path.join(os.path.abspath(root_dir), SOCKET_NAME)


def server_pid(root_dir: str) -> int | None:
    """The pid the root's fork server wrote when it started (it may have died since)."""
    try:
        with open(os.path.join(os.path.abspath(root_dir), PID_NAME)) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


async def read_ready_line(read_fd: int, timeout_s: float) -> str:
    """The first line written to a pipe ('ok PID' or 'error ...'); '' on EOF. Closes read_fd."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()
    buffer = bytearray()

    def on_readable() -> None:
        chunk = os.read(read_fd, 4096)
        buffer.extend(chunk)
        if (not chunk or b"\n" in buffer) and not ready.done():
            ready.set_result(bytes(buffer).split(b"\n")[0].decode("utf-8", "replace"))

    loop.add_reader(read_fd, on_readable)
    try:
        return await asyncio.wait_for(ready, timeout_s)
    finally:
        loop.remove_reader(read_fd)
        os.close(read_fd)


async def _start_detached(
    script: str, argument: str, extra: list[str], log_path: str, cwd: str, timeout_s: float
) -> str:
    """Run `python -S script ARGUMENT READY_FD EXTRA...` in a session of its own (it outlives
    the caller and its Ctrl-C), its output appended to `log_path`; the first line it writes
    to READY_FD (read_ready_line). Raises asyncio.TimeoutError."""
    read_fd, write_fd = os.pipe()
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-S", script, argument, str(write_fd), *extra],
            pass_fds=(write_fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            cwd=cwd,
            env=runtime_env(),
        )
    os.close(write_fd)
    register_child(process)  # collected by this process if it exits first
    return await read_ready_line(read_fd, timeout_s)


async def start_fork_server(root_dir: str, idle_exit_s: float | None = None) -> None:
    """Start the root's fork server, detached; returns once one (ours or another's) is up."""
    root_dir = ensure_root(root_dir)  # UnsafeSandboxRoot where another user could change it
    extra = [] if idle_exit_s is None else [str(idle_exit_s)]
    log_path = os.path.join(root_dir, ".forkserver.log")
    try:
        line = await _start_detached(FORKSERVER_SCRIPT, root_dir, extra, log_path, root_dir, _START_TIMEOUT_S)
    except TimeoutError:
        line = f"error it did not report ready within {_START_TIMEOUT_S:g} s"
    if line.startswith("ok ") or line.startswith("busy"):
        return  # "busy": another worker's server won the lock; it is binding its socket
    raise ForkServerUnavailable(f"the fork server in {root_dir} did not start: {line or 'it exited'}")


async def _ask(root_dir: str, op: str, timeout_s: float) -> int | None:
    """Send `op` (ping or stop) to the root's fork server; its pid, or None if none answers."""
    try:
        reader, writer = await open_unix_connection(socket_path(root_dir))
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    try:
        writer.write(protocol.pack({"op": op}))
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (TimeoutError, ConnectionError):
        return None
    finally:
        writer.close()
    return int(line.split()[1]) if line.startswith(b"ok ") else None


async def ping_fork_server(root_dir: str, timeout_s: float = 5.0) -> int | None:
    """The pid of the root's fork server if one answers, else None."""
    return await _ask(root_dir, "ping", timeout_s)


async def stop_fork_server(root_dir: str, timeout_s: float = 5.0) -> bool:
    """Ask the root's fork server to exit (its sandboxes live on); False when none answered."""
    pid = await _ask(root_dir, "stop", timeout_s)
    if pid is not None:
        deadline = time.monotonic() + timeout_s
        while pid_alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
    return pid is not None


async def _request_spawn(root_dir: str, request: dict, timeout_s: float) -> str | None:
    """The supervisor's ready line, or None when no fork server took the request."""
    try:
        reader, writer = await open_unix_connection(socket_path(root_dir))
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    try:
        writer.write(protocol.pack(request))
        try:
            accepted = await asyncio.wait_for(reader.readline(), 10.0)
        except (TimeoutError, ConnectionError):
            return None  # the server exited (idle) with our connection still queued
        if accepted != b"accepted\n":
            if accepted.startswith(b"error"):
                return accepted.decode("utf-8", "replace").strip()
            return None
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except TimeoutError:
            return f"error the supervisor did not report ready within {timeout_s:g} s"
        except ConnectionError:
            line = b""
        return line.decode("utf-8", "replace").strip()
    finally:
        writer.close()


async def spawn_supervisor(root_dir: str, plan_path: str, log_path: str, cwd: str, timeout_s: float) -> str:
    """Fork a supervisor for `plan_path` from the root's fork server, starting it if needed.

    Returns the supervisor's ready line ("ok PID", "error ...", or "" if it died first);
    raises ForkServerUnavailable when no fork server can be had.
    """
    request = {"op": "spawn", "plan_path": plan_path, "log_path": log_path, "cwd": cwd}
    deadline = time.monotonic() + _START_TIMEOUT_S
    started = False
    while True:
        line = await _request_spawn(root_dir, request, timeout_s)
        if line is not None:
            return line
        if time.monotonic() > deadline:
            raise ForkServerUnavailable(
                f"no fork server answers at {socket_path(root_dir)}; see {root_dir}/.forkserver.log"
            )
        if not started:
            await start_fork_server(root_dir)
            started = True
        else:
            await asyncio.sleep(0.01)  # another worker's server is binding, or ours is exiting


async def spawn_direct(plan_path: str, log_path: str, cwd: str, timeout_s: float) -> str:
    """Start a supervisor as a new interpreter (slower; no fork server needed)."""
    try:
        return await _start_detached(SUPERVISOR_SCRIPT, plan_path, [], log_path, cwd, timeout_s)
    except TimeoutError:
        return f"error the supervisor did not report ready within {timeout_s:g} s"
