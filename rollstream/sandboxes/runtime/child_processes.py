"""The processes of a sandbox's sessions (bash shells, the IPython kernel), as the supervisor
starts and ends them: spawned from one long-lived thread, joined to the sandbox's cgroups
before they exec, killed a whole session at a time; and the capped collector of their output.
Used by bash_session.py and kernel.py.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class OutputCollector:
    """Keeps the first and last `cap/2` bytes of a stream and counts the rest."""

    def __init__(self, cap_bytes: int) -> None:
        self.head_cap = max(cap_bytes // 2, 1)
        self.tail_cap = max(cap_bytes - self.head_cap, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            # Trim in batches so that a flood of small reads stays linear.
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + min(len(self.tail), self.tail_cap)

    def render(self) -> bytes:
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail else b""
        elided = self.total - len(self.head) - len(tail)
        if elided <= 0:
            return bytes(self.head) + tail
        marker = f"\n[... {elided:,} bytes of output elided ...]\n".encode()
        return bytes(self.head) + marker + tail


def kill_session_processes(*session_ids: int) -> None:
    """SIGKILL every process in the sessions `session_ids` (a pty child and all it started).

    One pass over /proc however many sessions: a pass costs milliseconds on a busy node.
    """
    own_pid = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own_pid:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[3]) in session_ids:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def join_cgroups(procs_files: list[str]) -> None:
    """Move the calling process into the sandbox's cgroups (see confine.py); runs before exec."""
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


class _Call(Generic[T]):
    """One call handed to the spawner's thread: its value or its error, once done."""

    def __init__(self, function: Callable[[], T]) -> None:
        self.function = function
        self.finished = threading.Event()
        self.value: list[T] = []
        self.error: list[BaseException] = []

    def run(self) -> None:
        try:
            self.value.append(self.function())
        except BaseException as error:  # handed back to the calling thread
            self.error.append(error)
        self.finished.set()

    def outcome(self) -> T:
        self.finished.wait()
        if self.error:
            raise self.error[0]
        return self.value[0]


class Spawner:
    """Starts child processes from one long-lived thread.

    bwrap --die-with-parent uses PR_SET_PDEATHSIG, which fires when the *thread* that
    forked the child exits; request threads are short-lived, this one is not.
    """

    def __init__(self) -> None:
        import queue

        self.requests: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="spawner").start()

    def _loop(self) -> None:
        while True:
            self.requests.get()()

    def __call__(self, function: Callable[[], T]) -> T:
        call = _Call(function)
        self.requests.put(call.run)
        return call.outcome()
