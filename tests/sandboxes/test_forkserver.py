"""The node's fork server: supervisors forked from it, reaped by it, and it restarts if killed."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from rollstream.cli.sandboxes import app as sandboxes_app
from rollstream.sandboxes import (
    Reaper,
    SandboxClient,
    SandboxHandle,
    SandboxSpec,
    SandboxStartError,
    create_sandbox,
    destroy_sandbox,
    reaper,
)
from rollstream.sandboxes.runtime import protocol
from rollstream.sandboxes.supervisor_spawn import server_pid, socket_path, spawn_direct, start_fork_server

from .conftest import needs_bwrap, planned_bwrap_sandbox, processes_mentioning

pytestmark = needs_bwrap


async def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """True once `pid` no longer exists at all (not even as a zombie).

    Fork servers this process started are its children: it collects them as a worker does.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reaper.reap_finished_children()
        if not psutil.pid_exists(pid):
            return True
        await asyncio.sleep(0.01)
    return False


def zombie_children(pid: int) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(pid).children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


async def test_supervisors_created_back_to_back_share_the_preloaded_kernel_client(root_dir):
    """The fork server preloads zmq and jupyter_client right after its first request, not in a
    lull that a warm pool creating sandboxes back to back never leaves: only that first
    supervisor would import them itself, 14 MB of its own, at its first cell."""
    handles = await asyncio.gather(
        *(create_sandbox(SandboxSpec(), sandbox_id=f"b{i}", root_dir=root_dir) for i in range(4))
    )
    try:
        preloaded = []
        for handle in handles:
            with open(f"/proc/{handle.supervisor_pid}/maps") as maps:
                preloaded.append("libzmq" in maps.read())
        assert sum(preloaded) >= 3, preloaded
    finally:
        await asyncio.gather(*(destroy_sandbox(handle) for handle in handles))


async def test_supervisors_are_forked_by_the_fork_server_and_reaped_by_it(root_dir):
    handles = [await create_sandbox(SandboxSpec(), sandbox_id=f"f{i}", root_dir=root_dir) for i in range(3)]
    server = server_pid(root_dir)
    assert server is not None
    for handle in handles:
        assert psutil.Process(handle.supervisor_pid).ppid() == server
        assert psutil.Process(handle.supervisor_pid).name() == "rs-supervisor"
        async with SandboxClient(handle.socket_path) as sb:
            assert (await sb.bash(f"echo {handle.id}")).output == f"{handle.id}\n"
    for handle in handles:
        await destroy_sandbox(handle)
        assert await gone(handle.supervisor_pid), "the fork server left a zombie"
    assert zombie_children(server) == []
    assert server_pid(root_dir) == server  # one server serves the whole root


async def test_killed_fork_server_is_restarted_and_its_sandboxes_live_on(root_dir):
    first = await create_sandbox(SandboxSpec(), sandbox_id="before", root_dir=root_dir)
    old_server = server_pid(root_dir)
    os.kill(old_server, signal.SIGKILL)
    assert await gone(old_server)  # it is our child: the test process collects it
    async with SandboxClient(first.socket_path) as sb:
        assert (await sb.bash("echo alive")).output == "alive\n"
    second = await create_sandbox(SandboxSpec(), sandbox_id="after", root_dir=root_dir)
    new_server = server_pid(root_dir)
    assert new_server not in (None, old_server)
    assert psutil.Process(second.supervisor_pid).ppid() == new_server
    for handle in (first, second):
        await destroy_sandbox(handle)
        assert not os.path.exists(handle.dir)
        assert processes_mentioning(handle.dir) == []
    assert await gone(second.supervisor_pid)


async def test_concurrent_starts_leave_one_fork_server(root_dir):
    await asyncio.gather(*(start_fork_server(root_dir) for _ in range(4)))

    def live_servers() -> list[int]:
        reaper.reap_finished_children()  # the losers exit right after reporting "busy"
        found = []
        for child in psutil.Process().children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and root_dir in " ".join(child.cmdline()):
                    found.append(child.pid)
            except psutil.Error:
                continue
        return found

    for _ in range(200):
        if len(live_servers()) == 1:
            break
        await asyncio.sleep(0.01)
    assert live_servers() == [server_pid(root_dir)]


async def test_fork_server_rebinds_a_removed_socket_and_exits_with_its_root(root_dir):
    await start_fork_server(root_dir)
    server = server_pid(root_dir)
    os.unlink(socket_path(root_dir))
    for _ in range(300):
        if os.path.exists(socket_path(root_dir)):
            break
        await asyncio.sleep(0.01)
    handle = await create_sandbox(SandboxSpec(), sandbox_id="rebound", root_dir=root_dir)
    assert psutil.Process(handle.supervisor_pid).ppid() == server
    await destroy_sandbox(handle)
    shutil.rmtree(root_dir)
    assert await gone(server), "the fork server outlived its root"


CREATOR = textwrap.dedent(
    """
    import asyncio, sys, time
    from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox

    async def main():
        handle = await create_sandbox(SandboxSpec(), sandbox_id="orphan", owner="job-9", root_dir=sys.argv[1])
        async with SandboxClient(handle.socket_path) as sb:
            await sb.bash("sleep 1000 &")
        print(handle.model_dump_json(), flush=True)
        time.sleep(1000)

    asyncio.run(main())
    """
)


async def test_sandbox_survives_its_creators_sigkill_and_is_reaped_without_zombies(root_dir):
    await start_fork_server(root_dir)  # the node's server, not the creator's child
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, root_dir], stdout=subprocess.PIPE)
    line = await asyncio.to_thread(creator.stdout.readline)
    handle = SandboxHandle.model_validate_json(line)
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    creator.stdout.close()
    async with SandboxClient(handle.socket_path) as sb:
        assert (await sb.bash("echo still here")).output == "still here\n"
    assert Reaper(root_dir).reap(lambda sandbox_id, owner: False) == ["orphan"]
    assert not os.path.exists(handle.dir)
    assert processes_mentioning(handle.dir) == []
    assert await gone(handle.supervisor_pid), "the supervisor was not reaped"
    assert zombie_children(server_pid(root_dir)) == []


async def test_supervisor_that_fails_to_start_reports_and_is_reaped(root_dir):
    empty_rootfs = os.path.join(root_dir, ".empty-rootfs")  # no bash in it
    os.mkdir(empty_rootfs)
    with pytest.raises(SandboxStartError, match="did not start"):
        await create_sandbox(SandboxSpec(image=empty_rootfs), sandbox_id="broken", root_dir=root_dir)
    server = server_pid(root_dir)
    assert server is not None
    for _ in range(200):
        if not zombie_children(server) and not psutil.Process(server).children():
            break
        await asyncio.sleep(0.01)
    assert psutil.Process(server).children() == []
    assert not os.path.exists(os.path.join(root_dir, "broken"))


async def test_bad_requests_are_answered_and_the_server_keeps_serving(root_dir):
    await start_fork_server(root_dir)
    for request in ({"op": "spawn", "plan_path": 3}, {"op": "nonsense"}):
        reader, writer = await asyncio.open_unix_connection(socket_path(root_dir))
        writer.write(protocol.pack(request))
        reply = (await reader.read()).decode()
        writer.close()
        assert "error" in reply
    handle = await create_sandbox(SandboxSpec(), sandbox_id="afterbad", root_dir=root_dir)
    await destroy_sandbox(handle)


def test_cli_starts_shows_and_stops_the_fork_server(root_dir):
    runner = CliRunner()
    assert "no fork server" in runner.invoke(sandboxes_app, ["forkserver", "--root-dir", root_dir]).output
    started = runner.invoke(sandboxes_app, ["forkserver", "--root-dir", root_dir, "--start"]).output
    pid = server_pid(root_dir)
    assert f"pid {pid}" in started
    assert "stopped" in runner.invoke(sandboxes_app, ["forkserver", "--root-dir", root_dir, "--stop"]).output
    deadline = time.monotonic() + 5
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)


async def test_a_supervisor_started_directly_serves_every_tool(root_dir):
    """Without a fork server, `python -S supervisor.py` runs with its siblings as top-level
    modules: every one it imports must be importable that way too."""
    layout, plan = planned_bwrap_sandbox(root_dir, "direct")
    line = await spawn_direct(layout.plan_path, layout.log_path, layout.dir, 60)
    assert line.startswith("ok "), (line, Path(layout.log_path).read_text()[-2000:])
    handle = SandboxHandle(id="direct", backend="bwrap", socket_path=layout.socket_path,
                           supervisor_pid=int(line.split()[1]), workdir=plan["workdir_inner"], owner=plan["owner"],
                           created_at=0.0, dir=layout.dir, host_workdir=layout.work)
    try:
        async with SandboxClient(layout.socket_path) as sb:
            assert (await sb.bash("echo direct")).output == "direct\n"
            assert (await sb.ipython("6 * 7")).result == "42"
            await sb.write_file("f.txt", "x")
            assert await sb.read_file("f.txt") == b"x"
    finally:
        await destroy_sandbox(handle)
