"""The IPython tool: a real kernel inside a bubblewrap sandbox, started on first use."""

from __future__ import annotations

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

    died = await sb.ipython("import os; os._exit(1)")
    assert "died" in died.note
    fresh = await sb.ipython("'x' in globals()")
    assert fresh.result == "False" and "restarted" in fresh.note
