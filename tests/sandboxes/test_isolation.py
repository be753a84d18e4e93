"""What a bubblewrap sandbox must not see: other sandboxes, the host network, host secrets."""

from __future__ import annotations

import asyncio
import os
import secrets

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox

from .conftest import needs_bwrap

pytestmark = needs_bwrap


async def test_thirty_two_sandboxes_cannot_see_each_others_files(root_dir):
    handles = await asyncio.gather(
        *(create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"iso{i}", root_dir=root_dir) for i in range(32))
    )
    try:

        async def write_and_look(index, handle):
            async with SandboxClient(handle.socket_path) as sb:
                await sb.bash(f"echo {index} > mine-{index}.txt && echo {index} > /tmp/tmp-{index}.txt")
                await asyncio.sleep(0.5)  # let every sandbox write first
                listing = await sb.bash(f"ls /workspace /tmp; ls {root_dir} 2>&1; ls /run/rollstream")
                return index, listing.output

        for index, output in await asyncio.gather(*(write_and_look(i, h) for i, h in enumerate(handles))):
            names = {word for word in output.split() if word.startswith(("mine-", "tmp-"))}
            assert names == {f"mine-{index}.txt", f"tmp-{index}.txt"}
            assert "No such file or directory" in output  # the sandbox root itself is not visible
    finally:
        await asyncio.gather(*(destroy_sandbox(h) for h in handles))


async def _connect_from_inside(sb, port: int) -> str:
    script = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=3).close(); print('CONNECTED')\n"
        "except OSError as error:\n"
        "    print('FAILED', error)\n"
    )
    await sb.write_file("probe.py", script)
    return (await sb.bash("python3 probe.py")).output


async def test_host_tcp_port_is_unreachable_without_network(root_dir):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="nonet", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert (await _connect_from_inside(sb, port)).startswith("FAILED")
    finally:
        await destroy_sandbox(handle)
        server.close()


async def test_network_true_reaches_the_host(root_dir):
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handle = await create_sandbox(SandboxSpec(backend="bwrap", network=True), sandbox_id="net", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            assert (await _connect_from_inside(sb, port)).startswith("CONNECTED")
    finally:
        await destroy_sandbox(handle)
        server.close()


async def test_host_environment_secrets_and_home_are_invisible(root_dir, monkeypatch):
    secret = secrets.token_hex(8)
    monkeypatch.setenv("ROLLSTREAM_TEST_API_KEY", secret)
    home_file = os.path.join(os.path.expanduser("~"), f".rs-test-{os.getpid()}")
    with open(home_file, "w") as handle_file:
        handle_file.write(secret)
    handle = await create_sandbox(
        SandboxSpec(backend="bwrap", env={"VISIBLE": "yes"}), sandbox_id="env", root_dir=root_dir
    )
    try:
        async with SandboxClient(handle.socket_path) as sb:
            env = (await sb.bash("env")).output
            assert secret not in env and "VISIBLE=yes" in env
            home = await sb.bash(f"cat {home_file}; ls -A {os.path.expanduser('~')}")
            assert secret not in home.output and "No such file" in home.output
            # The supervisor (which has the host env) is outside the sandbox's pid namespace.
            procs = await sb.bash("cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'")
            assert secret not in procs.output
            assert (await sb.bash("id -u")).output.strip() != "0"
    finally:
        os.remove(home_file)
        await destroy_sandbox(handle)


async def test_limits_are_applied_inside(root_dir):
    from rollstream.sandboxes import SandboxLimits

    spec = SandboxSpec(backend="bwrap", limits=SandboxLimits(memory_mb=512, max_processes=64, disk_mb=10))
    handle = await create_sandbox(spec, sandbox_id="limits", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            result = await sb.bash("ulimit -v; ulimit -u; ulimit -f")
            virtual, processes, file_size = result.output.split()
            assert [virtual, file_size] == [str(512 * 1024), str(10 * 1024)]
            # The process limit is the pids cgroup's where there is one (RLIMIT_NPROC would count
            # the sandbox's own host uid too and fail forks before the cgroup could tell), else the rlimit.
            held_by = (await sb.info())["limits"]["processes"]
            assert "pids.max=64" in held_by if held_by.startswith("cgroup") else processes == "64", (held_by, processes)
            big = await sb.bash("head -c 20M /dev/zero > big.bin; echo $?")
            assert big.output.strip() != "0"  # past RLIMIT_FSIZE the write fails
            memory = await sb.bash("python3 -c 'x = bytearray(1024 * 1024 * 1024)'")
            assert memory.exit_code != 0 and "MemoryError" in memory.output
    finally:
        await destroy_sandbox(handle)
