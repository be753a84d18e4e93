"""How many IPython kernels a node starts at once: a few lock files in the node's sandbox root.

A kernel's start is half a second to a second of CPU. Hundreds of first cells at once on a
small node (a group's rollouts all opening with Python) share the cores so thinly that every
start outlives its deadline, is killed and begins again from nothing: none ever comes up
(bench/density.py --kernels-at-once 256 on 2 cores: 14 of 256). Supervisors hold one of
`slots` flock()ed files while their kernel starts, so the others wait their turn and each
start gets the CPU it needs. A lock dies with the process that held it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time

SLOT_PREFIX = ".kernel-start-"
_POLL_S = 0.05


class StartSlotsBusy(RuntimeError):
    """No start slot came free in time: the node is starting too many kernels."""


def default_slots() -> int:
    """Two starts per core keep the cores busy while one start waits on its disk reads."""
    return max(2, 2 * (os.cpu_count() or 1))


class StartSlots:
    """`count` lock files named .kernel-start-N in `folder` (the node's sandbox root)."""

    def __init__(self, folder: str, count: int | None = None) -> None:
        self.folder = folder
        self.count = count or default_slots()

    def acquire(self, wait_s: float) -> int:
        """A descriptor holding a free slot; StartSlotsBusy once none came free in `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for index in range(self.count):
                path = os.path.join(self.folder, f"{SLOT_PREFIX}{index}")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as error:
                    os.close(fd)
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    continue
                return fd
            if time.monotonic() >= deadline:
                raise StartSlotsBusy(
                    f"{self.count} IPython kernels were already starting on this node for {wait_s:g} s; "
                    "run the cell again, or start fewer sandboxes' kernels at once"
                )
            time.sleep(_POLL_S)

    @staticmethod
    def release(fd: int) -> None:
        os.close(fd)  # closing the only descriptor of the open file drops its flock
