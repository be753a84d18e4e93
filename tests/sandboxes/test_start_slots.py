"""The node's kernel start slots: lock files in the sandbox root that pace kernel starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from rollstream.sandboxes.runtime.start_slots import (
    SLOT_PREFIX,
    StartSlots,
    StartSlotsBusy,
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
