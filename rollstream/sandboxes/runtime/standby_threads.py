"""Threads kept waiting for work, so that the supervisor hands a job to another thread for
the price of a queue put instead of a thread start.

The supervisor answers a slow request (a bash command) on the thread that read it, the one
already awake, and hands the reading of that connection on to another thread. Starting a
thread there costs the call about 50 µs (`Thread.start` waits until the new thread runs);
waking one that waits costs a few. One thread always waits: whichever takes a job starts
the next one first, off the caller's path. Used by supervisor.py.
"""

from __future__ import annotations

import queue
import socket
import threading
import traceback
from collections.abc import Callable


class StandbyThreads:
    """`run(function, *args)` calls `function(*args)` on a thread that was waiting for it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.SimpleQueue[tuple[Callable[..., object], tuple]] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.waiting = 0
        self._start_one()

    def run(self, function: Callable[..., object], *args: object) -> None:
        self.jobs.put((function, args))

    def _start_one(self) -> None:
        with self.lock:
            self.waiting += 1
        threading.Thread(target=self._wait_for_jobs, daemon=True, name=self.name).start()

    def _wait_for_jobs(self) -> None:
        while True:
            function, args = self.jobs.get()
            with self.lock:
                self.waiting -= 1
                last = self.waiting == 0
            if last:
                self._start_one()  # the next job finds a thread waiting
            try:
                function(*args)
            except Exception:  # the job's own failure; the thread waits for the next one
                traceback.print_exc()
            with self.lock:
                self.waiting += 1


class HandOff:
    """The connection of a request being answered (a bash session's `Caller`): `busy()`
    hands the reading of its next requests to a waiting thread, the first time."""

    __slots__ = ("args", "done", "fd", "threads")

    def __init__(self, threads: StandbyThreads, read: Callable[..., None], connection: socket.socket,
                 write_lock: threading.Lock) -> None:
        self.threads = threads
        self.args = (read, connection, write_lock)
        self.fd = connection.fileno()
        self.done = False

    def busy(self) -> None:
        if not self.done:
            self.done = True
            self.threads.run(*self.args)
