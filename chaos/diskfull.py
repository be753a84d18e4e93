"""A real full disk under Redis: a small tmpfs for its data folder (``--dir``), filled to the
last byte and freed again. Redis then refuses every write with MISCONF (its AOF cannot be
written) and accepts them again by itself once space is back: the fault the soak's
``full-disk`` phase and tests/security inject. Mounting a tmpfs needs root (CAP_SYS_ADMIN)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import redis


def cannot_mount() -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (run the soak's full-disk phase as root, e.g. in its container)"
    return None


class SmallDisk:
    """A tmpfs of ``size_mb`` at ``path``; ``fill()`` takes its last free byte, ``free()``
    gives the space back. Use as a context manager (unmounted at the end)."""

    def __init__(self, path: Path, size_mb: int = 4):
        self.path = Path(path)
        self.size_mb = size_mb
        self.filler = self.path / "filler"
        self.mounted = False

    def mount(self) -> SmallDisk:
        reason = cannot_mount()
        if reason:
            raise PermissionError(reason)
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", str(self.path)],
                       check=True, capture_output=True)
        self.mounted = True
        return self

    def fill(self) -> int:
        """Write a filler file until the disk has no byte left; returns its size."""
        chunk = b"\0" * 65536
        written = 0
        with open(self.filler, "ab", buffering=0) as fh:
            for size in (65536, 4096, 1):
                while True:
                    try:
                        written += fh.write(chunk[:size])
                    except OSError:  # ENOSPC: on to smaller writes, then done
                        break
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        if self.mounted:
            result = subprocess.run(["umount", str(self.path)], capture_output=True)
            if result.returncode != 0:  # something still has a file open there: detach it
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False

    def __enter__(self) -> SmallDisk:
        return self.mount()

    def __exit__(self, *exc) -> None:
        self.free()
        self.unmount()


def aof_write_failing(url: str) -> bool:
    """True while the Redis at ``url`` cannot write its AOF (it answers writes with MISCONF)."""
    info = redis.Redis.from_url(url, socket_timeout=5).info("persistence")
    return info.get("aof_last_write_status") == "err"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(interval_s)
