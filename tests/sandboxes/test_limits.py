"""Limits that hold as root: a cgroup per sandbox (processes, memory) and a sized tmpfs (disk).

Real bubblewrap, real kernel: a fork bomb, a disk filler, a memory hog and a double-forked
escapee, each inside a sandbox; the host keeps its processes, disk and memory, and nothing
of the sandbox is left after destroy or after the reaper cleaned up a killed supervisor.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from rollstream.sandboxes import (
    Reaper,
    SandboxClient,
    SandboxLimits,
    SandboxSpec,
    ToolError,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.reaper import live_supervisors
from rollstream.sandboxes.runtime import confine
from rollstream.sandboxes.supervisor_spawn import spawn_supervisor

from .conftest import needs_bwrap, planned_bwrap_sandbox, processes_mentioning

HIERARCHIES, WHY_NOT = confine.hierarchies()
CONTROLLERS = {name for hierarchy in HIERARCHIES for name in hierarchy.controllers}
needs_cgroups = pytest.mark.skipif(
    not {"pids", "memory"} <= CONTROLLERS, reason=f"no writable pids+memory cgroup here: {WHY_NOT}"
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs per sandbox needs root (mount)")
pytestmark = needs_bwrap


def _record(handle) -> dict:
    with open(os.path.join(handle.dir, confine.RECORD_NAME)) as handle_file:
        return json.load(handle_file)


def _mounted_under(directory: str) -> list[str]:
    with open("/proc/self/mountinfo") as handle:
        return [line.split()[4] for line in handle if line.split()[4].startswith(directory)]


def assert_released(handle, record: dict) -> None:
    assert not os.path.exists(handle.dir)
    assert [path for path in record["cgroups"] if os.path.exists(path)] == []
    assert _mounted_under(handle.dir) == []
    assert processes_mentioning(handle.dir) == []


@needs_cgroups
async def test_fork_bomb_is_held_by_the_cgroup_and_the_shell_recovers(root_dir):
    spec = SandboxSpec(backend="bwrap", limits=SandboxLimits(max_processes=64))
    handle = await create_sandbox(spec, sandbox_id="bomb", root_dir=root_dir)
    record = _record(handle)
    pids_cgroup = next(path for path in record["cgroups"] if os.path.exists(os.path.join(path, "pids.max")))
    try:
        async with SandboxClient(handle.socket_path) as sb:
            info = await sb.info()
            assert info["limits"]["processes"].startswith("cgroup v") and "pids.max=64" in info["limits"]["processes"]
            bomb = await sb.bash(":(){ :|:& };:", timeout_s=5)
            # Whatever the bomb does, its processes stay within pids.max ...
            for _ in range(20):
                with open(os.path.join(pids_cgroup, "pids.current")) as current:
                    assert int(current.read()) <= 64
                await asyncio.sleep(0.05)
            # ... the host still forks ...
            assert subprocess.run(["true"]).returncode == 0
            # ... and the next commands kill the bomb (if it still holds every slot) and get a
            # working shell back; the bomb's own result, or the next one, says the limit held.
            notes = [bomb.note]
            for _ in range(3):
                result = await sb.bash("echo recovered", timeout_s=15)
                notes.append(result.note)
                if result.output.endswith("recovered\n") and result.exit_code == 0:
                    break
            assert result.output.endswith("recovered\n"), (result, notes)
            assert any("process limit" in note for note in notes), notes
            with open(os.path.join(pids_cgroup, "pids.events")) as events:
                assert "max 0" not in events.read()  # forks did fail at the limit
            # bash may first report the bomb's last background job ("[1]+  Done  : | :"), as
            # an interactive shell does before its next command.
            assert (await sb.bash("echo still fine")).output.endswith("still fine\n")
    finally:
        await destroy_sandbox(handle)
    assert_released(handle, record)


@needs_cgroups
async def test_double_forked_daemon_is_killed_with_the_sandbox(root_dir):
    handle = await create_sandbox(SandboxSpec(backend="local", allow_unisolated=True), sandbox_id="daemon",
                                  root_dir=root_dir)
    record = _record(handle)
    async with SandboxClient(handle.socket_path) as sb:
        # setsid + double fork: a new session, reparented away from the shell and its supervisor.
        await sb.bash("setsid sh -c 'sleep 1000 & echo $! > daemon.pid' < /dev/null > /dev/null 2>&1")
        await sb.bash("for i in $(seq 50); do [ -s daemon.pid ] && break; sleep 0.1; done")
        pid = int((await sb.read_file("daemon.pid")).decode())
    assert os.path.exists(f"/proc/{pid}")
    await destroy_sandbox(handle)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            assert stat.read().split(")")[1].split()[0] == "Z"  # killed, awaiting its reaper
    except FileNotFoundError:
        pass  # killed and collected
    assert_released(handle, record)


@needs_root
async def test_filling_the_disk_hits_enospc_inside_and_the_sandbox_recovers(root_dir):
    spec = SandboxSpec(backend="bwrap", limits=SandboxLimits(disk_mb=16, memory_mb=1024))
    handle = await create_sandbox(spec, sandbox_id="disk", root_dir=root_dir)
    record = _record(handle)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert (await sb.info())["limits"]["disk"].startswith("tmpfs of 16 MiB")
            # Several files, so that the per-file RLIMIT_FSIZE is not what stops them.
            filled = await sb.bash("head -c 10M /dev/zero > a.bin; yes > /tmp/b.txt; echo rc=$?", timeout_s=60)
            assert "No space left on device" in filled.output and "rc=1" in filled.output
            assert "full" in filled.note
            usage = await sb.bash("df -k /workspace | tail -1")
            assert int(usage.output.split()[1]) <= 16 * 1024  # the limit, not the host's disk
            with pytest.raises(ToolError, match="no space left"):
                await sb.write_file("more.bin", b"x" * 2**20)
            with pytest.raises(ToolError, match="no space left"):
                await sb.edit("create", "more.py", file_text="x = 1\n" * 200_000)
            await sb.bash("rm -f /tmp/b.txt")
            await sb.write_file("more.bin", b"x" * 2**20)
            assert (await sb.bash("wc -c < more.bin")).output.strip() == str(2**20)
    finally:
        await destroy_sandbox(handle)
    assert_released(handle, record)


@needs_cgroups
async def test_memory_hog_of_many_processes_is_held_by_the_cgroup(root_dir):
    # Each process stays under RLIMIT_AS; together they exceed the sandbox's memory.
    spec = SandboxSpec(backend="bwrap", limits=SandboxLimits(memory_mb=256))
    handle = await create_sandbox(spec, sandbox_id="hog", root_dir=root_dir)
    record = _record(handle)
    hog = (
        "import time\n"
        "block = bytearray(150 * 2**20)\n"
        "for i in range(0, len(block), 4096): block[i] = 1\n"
        "print('holding', flush=True); time.sleep(3)\n"
    )
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert "limit 256 MiB" in (await sb.info())["limits"]["memory"]
            await sb.write_file("hog.py", hog)
            result = await sb.bash("python3 hog.py & python3 hog.py & wait; echo done", timeout_s=60)
            assert "done" in result.output
            assert result.output.count("holding") < 2 or "Killed" in result.output
            assert (await sb.bash("echo alive")).output == "alive\n"
    finally:
        await destroy_sandbox(handle)
    assert_released(handle, record)


async def test_reaper_releases_the_cgroup_and_tmpfs_of_a_killed_supervisor(root_dir):
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="crash", root_dir=root_dir)
    record = _record(handle)
    async with SandboxClient(handle.socket_path) as sb:
        await sb.bash("sleep 1000 > /dev/null 2>&1 &")
    os.kill(handle.supervisor_pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    assert Reaper(root_dir).reap(lambda sandbox_id, owner: True) == ["crash"]
    assert_released(handle, record)


@needs_root
async def test_reaper_releases_a_supervisor_killed_while_its_shell_was_starting(root_dir):
    """A node cancelled mid-creation: the supervisor had mounted the sandbox's tmpfs and was
    waiting for its shell when it was SIGKILLed. The reaper must see a dead supervisor (not a
    sandbox still being created, which it leaves alone for minutes) and release the mount."""
    # A shell that never answers: start() waits for it.
    layout, _plan = planned_bwrap_sandbox(root_dir, "halfmade", bash_argv=["sleep", "1000"])
    starting = asyncio.ensure_future(spawn_supervisor(root_dir, layout.plan_path, layout.log_path, layout.dir, 60))
    try:
        for _ in range(300):
            if _mounted_under(layout.dir) and live_supervisors(root_dir):
                break
            await asyncio.sleep(0.02)
        assert _mounted_under(layout.dir), "the supervisor never mounted the sandbox's tmpfs"
        record = _record(layout)
        for supervisor in live_supervisors(root_dir):
            supervisor.kill()
        await starting
    finally:
        starting.cancel()
    assert Reaper(root_dir).reap(lambda sandbox_id, owner: True) == ["halfmade"]
    assert_released(layout, record)


async def test_info_names_the_mechanism_behind_each_limit(sb):
    limits = (await sb.info())["limits"]
    assert set(limits) >= {"processes", "memory", "cpu", "disk", "fallback_reason"}
    if "pids" in CONTROLLERS:
        assert limits["processes"].startswith("cgroup v")
    elif os.geteuid() == 0:
        assert "NOT enforced" in limits["processes"] and limits["fallback_reason"]
    else:
        assert limits["processes"].startswith("RLIMIT_NPROC")
    assert limits["disk"].startswith("tmpfs" if os.geteuid() == 0 else "usage polled")
