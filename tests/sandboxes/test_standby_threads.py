"""The supervisor's waiting threads: every job starts at once on a thread of its own, however
many block, and a job that raises leaves the threads serving."""

from __future__ import annotations

import threading
import time

from rollstream.sandboxes.runtime.standby_threads import StandbyThreads


def test_blocking_jobs_each_get_a_thread_and_a_failing_one_is_survived(capsys):
    threads = StandbyThreads("test")
    release = threading.Event()
    started = threading.Semaphore(0)
    names = []

    def blocking(index: int) -> None:
        names.append(threading.current_thread().ident)
        started.release()
        release.wait(10)

    def failing() -> None:
        raise RuntimeError("a job's own failure")

    threads.run(failing)
    for index in range(8):
        threads.run(blocking, index)
    # All eight run together: none waits for another to end.
    assert all(started.acquire(timeout=10) for _ in range(8))
    assert len(set(names)) == 8 and threading.get_ident() not in names
    release.set()
    done = threading.Event()
    threads.run(done.set)
    assert done.wait(10)
    told = ""  # printed by the failing job's thread, which may still be at it
    deadline = time.monotonic() + 10
    while "a job's own failure" not in told and time.monotonic() < deadline:
        told += capsys.readouterr().err
        time.sleep(0.01)
    assert "a job's own failure" in told
