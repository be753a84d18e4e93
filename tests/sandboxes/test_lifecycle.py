"""Sandbox lifecycle: create, hand over, destroy, and reaping when the creator dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from rollstream.sandboxes import (
    BackendUnavailable,
    Reaper,
    SandboxClient,
    SandboxGone,
    SandboxHandle,
    SandboxLimits,
    SandboxSetupError,
    SandboxSpec,
    become_subreaper,
    create_sandbox,
    destroy_sandbox,
)

from .conftest import needs_bwrap, processes_mentioning


def assert_nothing_left(handle: SandboxHandle) -> None:
    assert not os.path.exists(handle.dir)
    assert processes_mentioning(handle.dir) == []
    try:
        assert psutil.Process(handle.supervisor_pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


@needs_bwrap
async def test_files_and_setup_commands_are_in_place(root_dir):
    spec = SandboxSpec(files={"src/app.py": "print('hi')\n"}, setup_commands=["python3 src/app.py > out.txt"])
    handle = await create_sandbox(spec, sandbox_id="setup", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert await sb.read_file("out.txt") == b"hi\n"
            assert (await sb.info())["sessions"] == ["main"]  # the setup session is closed
    finally:
        await destroy_sandbox(handle)


@needs_bwrap
async def test_failing_setup_command_raises_and_leaves_nothing(root_dir):
    spec = SandboxSpec(setup_commands=["echo broken >&2; exit 3"])
    with pytest.raises(SandboxSetupError, match="broken"):
        await create_sandbox(spec, sandbox_id="badsetup", root_dir=root_dir)
    assert [name for name in os.listdir(root_dir) if not name.startswith(".forkserver")] == []
    assert processes_mentioning(os.path.join(root_dir, "badsetup")) == []


@needs_bwrap
@pytest.mark.parametrize("after_s", [0.0, 0.005, 0.02, 0.05])
async def test_cancelled_while_starting_leaves_nothing(root_dir, after_s):
    """A job cancelled during init cancels its create_sandbox mid-start: the supervisor
    that was being started is taken down with its folder, not left running."""
    creating = asyncio.ensure_future(create_sandbox(SandboxSpec(), sandbox_id="halfmade", root_dir=root_dir))
    await asyncio.sleep(after_s)
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    assert [name for name in os.listdir(root_dir) if not name.startswith(".forkserver")] == []
    assert processes_mentioning(os.path.join(root_dir, "halfmade")) == []


@needs_bwrap
async def test_handle_travels_as_a_dict_and_destroy_is_idempotent(root_dir):
    handle = await create_sandbox(SandboxSpec(), sandbox_id="travel", root_dir=root_dir)
    rebuilt = SandboxHandle.model_validate(json.loads(json.dumps(handle.model_dump())))
    async with SandboxClient(rebuilt.socket_path) as sb:
        await sb.bash("sleep 1000 &")  # a background job must not survive either
        await sb.ipython("x = 1")
        await sb.write_file("/tmp/data.bin", b"\x00\x01")
        assert await sb.read_file("/tmp/data.bin") == b"\x00\x01"
    await destroy_sandbox(rebuilt.model_dump())
    await destroy_sandbox(rebuilt)
    assert_nothing_left(handle)
    with pytest.raises(SandboxGone):
        await SandboxClient(handle.socket_path).connect()


@needs_bwrap
async def test_idle_supervisor_destroys_itself(root_dir):
    spec = SandboxSpec(limits=SandboxLimits(idle_timeout_s=1))
    handle = await create_sandbox(spec, sandbox_id="idle", root_dir=root_dir)
    for _ in range(100):
        if not os.path.exists(handle.dir):
            break
        await asyncio.sleep(0.1)
    await destroy_sandbox(handle)  # collects the exit status; nothing else to do
    assert_nothing_left(handle)


CREATOR = textwrap.dedent(
    """
    import asyncio, sys, time
    from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox

    async def main():
        handle = await create_sandbox(SandboxSpec(), sandbox_id="orphan", owner="job-1", root_dir=sys.argv[1])
        async with SandboxClient(handle.socket_path) as sb:
            await sb.bash("sleep 1000 &")
            await sb.ipython("1")
        print(handle.model_dump_json(), flush=True)
        time.sleep(1000)

    asyncio.run(main())
    """
)


@needs_bwrap
async def test_sigkill_of_the_creator_leaves_a_sandbox_the_reaper_cleans(root_dir):
    become_subreaper()  # orphaned supervisors become our children, so none stays a zombie
    creator = subprocess.Popen(
        [sys.executable, "-c", CREATOR, root_dir], stdout=subprocess.PIPE, cwd=os.getcwd()
    )
    line = await asyncio.to_thread(creator.stdout.readline)
    handle = SandboxHandle.model_validate_json(line)
    creator.send_signal(signal.SIGKILL)
    creator.wait()
    creator.stdout.close()
    # The sandbox outlives its creator ...
    async with SandboxClient(handle.socket_path) as sb:
        assert (await sb.bash("echo still here")).output == "still here\n"
    reaper = Reaper(root_dir)
    assert reaper.reap(lambda sandbox_id, owner: owner == "job-1") == []
    # ... until its job is no longer wanted.
    assert reaper.reap(lambda sandbox_id, owner: False) == ["orphan"]
    assert_nothing_left(handle)


@needs_bwrap
async def test_reaper_cleans_what_a_killed_supervisor_left(root_dir):
    handle = await create_sandbox(SandboxSpec(), sandbox_id="crashed", root_dir=root_dir)
    os.kill(handle.supervisor_pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    assert os.path.exists(handle.dir)
    assert Reaper(root_dir).reap(lambda sandbox_id, owner: True) == ["crashed"]
    assert_nothing_left(handle)


async def test_local_backend_needs_an_explicit_opt_in(root_dir):
    with pytest.raises(BackendUnavailable, match="allow_unisolated"):
        await create_sandbox(SandboxSpec(backend="local"), sandbox_id="local", root_dir=root_dir)
    handle = await create_sandbox(
        SandboxSpec(backend="local", allow_unisolated=True), sandbox_id="local", root_dir=root_dir
    )
    try:
        async with SandboxClient(handle.socket_path) as sb:
            result = await sb.bash("pwd")
            assert result.output.strip() == handle.host_workdir
    finally:
        await destroy_sandbox(handle)
    assert_nothing_left(handle)


@needs_bwrap
async def test_sandbox_under_a_root_too_long_for_a_socket_address_still_serves_tools(root_dir):
    deep_root = os.path.join(root_dir, "d" * 60, "e" * 60)  # the socket path is far past 107 bytes
    os.makedirs(deep_root)
    for folder in (os.path.dirname(deep_root), deep_root):
        os.chmod(folder, 0o711)
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="deep", root_dir=deep_root)
    try:
        assert len(handle.socket_path) > 107
        async with SandboxClient(handle.socket_path) as sandbox:
            assert (await sandbox.bash("echo $((40+2))")).output.strip() == "42"
    finally:
        await destroy_sandbox(handle)
    assert_nothing_left(handle)


@needs_bwrap
async def test_a_sandbox_replaced_under_the_same_id_since_the_reaper_listed_it_is_left_alone(root_dir):
    """Eval's verification destroys the agent's sandbox and starts a fresh one under the job's
    id: a reaper that listed the old one just before must not tear the new one down."""
    old = await create_sandbox(SandboxSpec(), sandbox_id="verified", owner="job-1", root_dir=root_dir)
    reaper = Reaper(root_dir)
    [listed] = [r for r in reaper.sandboxes() if r.id == "verified"]
    await destroy_sandbox(old)
    new = await create_sandbox(SandboxSpec(), sandbox_id="verified", owner="job-1", root_dir=root_dir)
    try:
        # The listing's verdict came before the replacement: nobody wanted the sandbox it saw.
        assert not await asyncio.to_thread(reaper.reap_one, listed, lambda _id, _owner: False)
        client = await SandboxClient(new.socket_path).connect()
        try:
            assert (await client.bash("echo still here")).output.strip() == "still here"
        finally:
            await client.close()
    finally:
        await destroy_sandbox(new)
