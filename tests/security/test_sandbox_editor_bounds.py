"""Hole 5 and the classes around it: no file the agent makes can grow or wedge the supervisor
(which runs outside the sandbox's memory limit). A 300 MB sparse file is viewed in bounded
memory and refused for edits; a FIFO, a socket or a folder gets a clear error at once, and the
editor keeps serving; symlinks and '..' in paths never lead out of the sandbox."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from sandboxes.conftest import needs_bwrap, root_dir, sandbox, sb  # noqa: F401  (fixtures)

from rollstream.agent.tools import CallToolAdapter, call_with_timeout
from rollstream.sandboxes import SandboxClient, ToolError, tool_schemas
from rollstream.sandboxes.runtime.editor import EDIT_MAX_BYTES, LIST_MAX_ENTRIES

pytestmark = needs_bwrap
CALL_S = 60  # a call that would hang (the old FIFO view) fails the test instead of stalling it


async def call(coroutine):
    return await asyncio.wait_for(coroutine, CALL_S)


async def test_a_huge_sparse_file_is_viewed_in_bounded_memory_and_refused_for_edits(sb, sandbox):
    assert (await sb.bash("truncate -s 300M big && printf '\\na\\nb\\n' >> big")).exit_code == 0
    supervisor = psutil.Process(sandbox.supervisor_pid)
    before = supervisor.memory_info().rss
    shown = (await call(sb.edit("view", "big"))).output
    assert "elided" in shown and shown.endswith("     2\ta\n     3\tb") and len(shown.encode()) < 200_000
    ranged = (await call(sb.edit("view", "big", view_range=[2, 3]))).output
    assert ranged == "     2\ta\n     3\tb"
    for edit in (lambda: sb.edit("str_replace", "big", old_str="a", new_str="b"),
                 lambda: sb.edit("insert", "big", insert_line=0, new_str="x")):
        with pytest.raises(ToolError, match=f"{EDIT_MAX_BYTES:,}"):
            await call(edit())
    for max_bytes in (None, 10**12):
        with pytest.raises(ToolError, match="max_bytes"):
            await call(sb.read_file("big", max_bytes=max_bytes))
    assert await call(sb.read_file("big", max_bytes=4)) == b"\0" * 4
    grown = supervisor.memory_info().rss - before
    assert grown < 100 * 2**20, f"the supervisor grew by {grown // 2**20} MiB"


async def test_fifos_sockets_and_folders_get_a_clear_error_and_never_wedge_the_editor(sb, sandbox):
    made = await sb.bash("mkfifo fifo && python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
                         "s.bind('sock')\" && mkdir folder && echo ok > ok.txt")
    assert made.exit_code == 0, made.output

    def attempts(name: str) -> tuple:
        return (lambda: sb.edit("view", name), lambda: sb.edit("view", name, view_range=[1, 1]),
                lambda: sb.edit("str_replace", name, old_str="a", new_str="b"),
                lambda: sb.edit("insert", name, insert_line=0, new_str="x"),
                lambda: sb.edit("create", name, file_text="x"), lambda: sb.read_file(name),
                lambda: sb.write_file(name, b"x"))

    for name, kind in (("fifo", "FIFO"), ("sock", "socket")):
        for attempt in attempts(name):
            with pytest.raises(ToolError, match=kind):
                await call(attempt())
    for attempt in (lambda: sb.edit("str_replace", "folder", old_str="a", new_str="b"),
                    lambda: sb.read_file("folder"), lambda: sb.write_file("folder", b"x")):
        with pytest.raises(ToolError, match="directory|folder"):
            await call(attempt())
    # Still serving, on this connection and a new one.
    assert (await call(sb.edit("view", "ok.txt"))).output == "     1\tok"
    async with SandboxClient(sandbox.socket_path) as fresh:
        assert (await call(fresh.edit("view", "ok.txt"))).output == "     1\tok"


async def test_listings_are_bounded_and_never_follow_a_symlink_out(sb):
    made = await sb.bash(f"mkdir many && cd many && touch $(seq -f 'f%g' 1 {LIST_MAX_ENTRIES + 500}) && cd .. "
                         "&& ln -s /etc etc_link && ln -s ../../../../../etc/passwd up_link")
    assert made.exit_code == 0, made.output
    listing = (await call(sb.edit("view", "many"))).output.splitlines()
    assert len(listing) <= LIST_MAX_ENTRIES + 1 and "not listed" in listing[-1]
    top = (await call(sb.edit("view", "."))).output
    assert "etc_link" in top and "passwd" not in top.replace("up_link", "")
    for path in ("etc_link/passwd", "up_link", "../../../../etc/passwd", "/etc/passwd", "many/../../x"):
        with pytest.raises(ToolError, match="outside"):
            await call(sb.edit("view", path))


async def test_the_agent_loop_bounds_each_tool_call_by_tool_timeout_s(sb, sandbox):
    tools = CallToolAdapter(sb, tool_schemas(["bash"]))
    output = await call(call_with_timeout(tools, "bash", {"command": "sleep 60"}, 1.0))
    assert not output.ok and output.error == "timeout" and "timed out" in output.text
    assert (await call(sb.info()))["pid"] == sandbox.supervisor_pid  # and the sandbox serves on


async def test_bash_and_ipython_on_a_fifo_or_a_huge_file_end_in_time_with_the_supervisor_small(sb, sandbox):
    assert (await sb.bash("mkfifo fifo && truncate -s 16M big")).exit_code == 0
    supervisor = psutil.Process(sandbox.supervisor_pid)
    before = supervisor.memory_info().rss
    stuck = await call(sb.bash("cat fifo", timeout_s=2))
    assert stuck.timed_out
    flood = await call(sb.bash("cat big"))
    assert flood.truncated and flood.total_bytes == 16 * 2**20 and len(flood.output_bytes) < 200_000
    cell = await call(sb.ipython("open('fifo').read()", timeout_s=2))
    assert cell.timed_out
    big = await call(sb.ipython("print(open('big').read())", timeout_s=60))
    assert big.truncated and len(big.stdout) < 200_000
    assert (await call(sb.bash("echo still serving"))).output == "still serving\n"
    grown = supervisor.memory_info().rss - before
    assert grown < 100 * 2**20, f"the supervisor grew by {grown // 2**20} MiB"
