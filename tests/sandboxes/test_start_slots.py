"""The node's kernel start slots: lock files in the sandbox root that pace kernel starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rollstream.sandboxes.runtime.kernel import Kernel, KernelStartError
from rollstream.sandboxes.runtime.start_slots import (
    SLOT_PREFIX,
    StartSlots,
    StartSlotsBusy,
    default_slots,
)


def test_a_start_waits_for_a_free_slot_and_a_dead_holder_frees_its_own(tmp_path):
    slots = StartSlots(str(tmp_path), count=2)
    first, second = slots.acquire(1), slots.acquire(1)
    with pytest.raises(StartSlotsBusy, match="2 IPython kernels were already starting"):
        slots.acquire(0.2)
    slots.release(first)
    third = slots.acquire(1)
    slots.release(second)
    slots.release(third)
    # Another process (a supervisor) holds both slots and dies without releasing them.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from rollstream.sandboxes.runtime.start_slots import StartSlots
        slots = StartSlots({str(tmp_path)!r}, count=2)
        slots.acquire(5), slots.acquire(5)
        print("held", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StartSlotsBusy):
            slots.acquire(0.2)
    finally:
        holder.kill()
        holder.wait()
    slots.release(slots.acquire(5))
    assert sorted(os.listdir(tmp_path)) == [f"{SLOT_PREFIX}0", f"{SLOT_PREFIX}1"]


def test_a_kernel_that_starts_slowly_gives_its_slot_back_before_it_is_up(tmp_path):
    """A sandbox can make its kernel's start slow (an IPython startup script in its own /tmp):
    the start keeps its slot only `slot_hold_s`, so other sandboxes' kernels are not held back."""
    slots = StartSlots(str(tmp_path / "root"), count=default_slots())
    os.makedirs(slots.folder)
    held = [slots.acquire(1) for _ in range(slots.count - 1)]  # the kernel gets the last one
    kernel = Kernel([], [sys.executable, "-c", "import time; time.sleep(120)"], {"PATH": "/usr/bin:/bin"},
                    str(tmp_path), {}, str(tmp_path / "k"), str(tmp_path / "k"), 1 << 16, str(tmp_path / "log"),
                    start_timeout_s=60, start_slots_dir=slots.folder, slot_hold_s=0.2)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            kernel.start()
        except KernelStartError as error:
            errors.append(error)

    starting = threading.Thread(target=start)
    starting.start()
    try:
        while kernel.process is None and starting.is_alive():  # it took the last slot and started
            time.sleep(0.01)
        freed = slots.acquire(30)  # the kernel's slot, while its start still waits for it
        assert starting.is_alive() and kernel.alive
        held.append(freed)
    finally:
        while kernel.process is None and starting.is_alive():
            time.sleep(0.01)
        if kernel.process is not None:
            kernel.process.kill()  # the start sees its kernel exit and gives up
        starting.join(60)
        for fd in held:
            slots.release(fd)
    assert errors and "exited" in str(errors[0])
