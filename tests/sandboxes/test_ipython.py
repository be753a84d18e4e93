"""The IPython tool: a real kernel inside a bubblewrap sandbox, started on first use."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollstream.sandboxes.capacity import process_trees
from rollstream.sandboxes.runtime.start_slots import StartSlots, default_slots

from .conftest import needs_bwrap

pytestmark = needs_bwrap

PNG_1PX = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="


async def test_state_output_errors_images_timeout_and_restart(sb):
    # One test, one kernel: a kernel takes a second or more to start on a small machine.
    first = await sb.ipython("x = 20; print('to stdout'); import sys; print('to stderr', file=sys.stderr)")
    assert first.stdout == "to stdout\n" and first.stderr == "to stderr\n"
    assert (await sb.ipython("x + 22")).result == "42"
    assert (await sb.ipython("import os; os.getcwd()")).result == "'/workspace'"

    error = await sb.ipython("1 / 0")
    assert "ZeroDivisionError" in error.error and "\x1b[" not in error.error

    image = await sb.ipython(
        f"from IPython.display import Image, display; import base64; display(Image(data=base64.b64decode('{PNG_1PX}')))"
    )
    assert image.images_png_b64 == [PNG_1PX]

    slow = await sb.ipython("import time; time.sleep(30)", timeout_s=1)
    assert slow.timed_out and slow.interrupted and "KeyboardInterrupt" in slow.error
    assert (await sb.ipython("x")).result == "20"  # interrupted, not restarted

    # Bytes written to fd 1 itself (os.write, a child process) come with the cell that wrote
    # them, every time: ipykernel's own flush lost the pipe's tail in 2 of 30 cells.
    for _ in range(30):
        raw = await sb.ipython("import subprocess\nfor _ in range(30): os.write(1, b'y' * 1000)\n"
                               "subprocess.run(['echo', 'END'])")
        assert raw.stdout == "y" * 30000 + "END\n", len(raw.stdout)

    died = await sb.ipython("import os; os._exit(1)")
    assert "died" in died.note
    fresh = await sb.ipython("'x' in globals()")
    assert fresh.result == "False" and "restarted" in fresh.note


async def test_a_running_cell_leaves_the_connection_answering(sb):
    """The thread running a cell watches its connection: a bash call and a ping sent on the
    same connection meanwhile are read by another thread and answered at once."""
    await sb.ipython("1")  # the kernel is up
    slow = asyncio.create_task(sb.ipython("import time; time.sleep(1.5); 'slept'"))
    await asyncio.sleep(0.3)
    assert (await sb.bash("echo beside")).output == "beside\n"
    assert (await sb.ping()) > 0 and not slow.done()
    assert (await slow).result == "'slept'"


async def test_the_kernel_starts_without_its_debugger_and_cells_still_get_all_they_need(sb):
    """debugpy (Jupyter's debug protocol, a quarter of a kernel's memory) and jupyter_client's kernel
    manager are not loaded at start; a cell that imports them gets them, whole, and an error shows
    the frames of the cell's own functions."""
    loaded = "[name in sys.modules for name in ('debugpy', 'jupyter_client.manager', 'importlib.metadata')]"
    assert (await sb.ipython(f"import sys; {loaded}")).result == "[False, False, False]"
    assert (await sb.ipython("import debugpy; callable(debugpy.listen)")).result == "True"
    whole = await sb.ipython("import jupyter_client; jupyter_client.KernelManager.__name__, jupyter_client.__version__")
    assert whole.error is None and whole.result.startswith("('KernelManager', '")
    assert (await sb.ipython(f"{loaded}")).result == "[True, True, True]"
    error = await sb.ipython("def inner():\n    return {}['missing']\ndef outer():\n    return inner()\nouter()")
    assert "KeyError" in error.error and "outer()" in error.error and "return inner()" in error.error


async def test_kernels_start_in_turn_when_the_node_is_starting_as_many_as_it_may(sb, sandbox, root_dir):
    """Hundreds of first cells at once would share the cores so thinly that no kernel came up in
    time (bench/density.py): a start waits for one of the node's start slots, and its cell's
    timeout only begins once its kernel is ready."""
    slots = StartSlots(root_dir)
    held = [slots.acquire(5) for _ in range(default_slots())]
    try:
        cell = asyncio.create_task(sb.ipython("21 * 2", timeout_s=5))
        await asyncio.sleep(1.0)
        assert not cell.done()
        assert not [pid for pid in process_trees([sandbox.supervisor_pid])[sandbox.supervisor_pid]
                    if b"ipykernel" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    finally:
        for fd in held:
            slots.release(fd)
    answer = await cell
    assert answer.result == "42" and not answer.timed_out
