"""Hostile input inside real bubblewrap sandboxes: escapes, odd bytes, crashing tool calls, the node's Redis.

Fork bombs and full disks live in test_limits.py; here each test feeds the sandbox what an
adversarial (or unlucky) model would, and checks that nothing leaves it and it keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from rollstream.sandboxes import SandboxClient, SandboxSpec, ToolError, create_sandbox, destroy_sandbox
from rollstream.sandboxes.runtime import protocol

from .conftest import needs_bwrap

pytestmark = needs_bwrap


@pytest.fixture
def outside():
    """A host folder outside every sandbox, with a file the sandbox must neither read nor change."""
    path = tempfile.mkdtemp(prefix="rs-outside-", dir="/var/tmp")
    with open(os.path.join(path, "secret.txt"), "w") as handle:
        handle.write("host secret\n")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_editor_and_file_calls_cannot_escape_by_dots_absolute_paths_or_symlinks(sb, outside):
    await sb.bash(f"ln -s {outside}/secret.txt file-link; ln -s {outside} dir-link; ln -s / root-link")
    for path in ["../../etc/passwd", "/etc/passwd", "../" * 12 + outside, f"{outside}/secret.txt"]:
        with pytest.raises(ToolError, match="outside the sandbox"):
            await sb.edit("view", path)
    for path in ["file-link", "dir-link/secret.txt", "root-link/etc/passwd"]:
        with pytest.raises(ToolError, match="outside"):
            await sb.edit("view", path)
        with pytest.raises(ToolError, match="outside"):
            await sb.read_file(path)
    with pytest.raises(ToolError, match="outside"):
        await sb.edit("create", "dir-link/planted.txt", file_text="x")
    with pytest.raises(ToolError, match="outside"):
        await sb.write_file("root-link" + outside + "/planted.txt", b"x")
    with pytest.raises(ToolError, match="outside"):
        await sb.edit("str_replace", "file-link", old_str="host", new_str="pwned")
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    with open(os.path.join(outside, "secret.txt")) as handle:
        assert handle.read() == "host secret\n"
    # A symlink that stays inside is fine.
    await sb.bash("mkdir -p src && ln -s src alias")
    await sb.edit("create", "alias/ok.py", file_text="print(1)\n")
    assert (await sb.bash("cat src/ok.py")).output == "print(1)\n"


async def test_symlink_swapped_in_during_edits_never_redirects_a_write(sb, outside):
    # The sandbox flips `race` between a folder and a symlink to a host folder while the
    # (root) supervisor writes race/planted.txt: a check-then-open editor would write outside.
    flipper = (
        f"for i in $(seq 4000); do rm -rf race; mkdir race; rm -rf race; ln -s {outside} race; done "
        ">/dev/null 2>&1 &"
    )
    await sb.bash(flipper)
    refused = written = 0
    for _ in range(300):
        try:
            await sb.edit("create", "race/planted.txt", file_text="planted\n")
            written += 1
        except ToolError:
            refused += 1
    await sb.bash("kill %1 2>/dev/null; wait", timeout_s=30)
    assert written + refused == 300
    assert sorted(os.listdir(outside)) == ["secret.txt"]


async def test_nul_bytes_and_invalid_utf8_survive_as_data_in_bash_ipython_and_files(sb):
    # Each byte below comes back exactly, in bash output, a file, and the kernel's output.
    raw = b"a\x00b\xff\xfe\xc3(c\xed\xa0\x80d\n"
    await sb.write_file("raw.bin", raw)
    assert await sb.read_file("raw.bin") == raw
    result = await sb.bash("cat raw.bin; printf 'x\\0y\\n'")
    assert result.output_bytes == raw + b"x\x00y\n"
    assert "\\xff" in result.output and result.exit_code == 0
    text = await sb.call_tool("bash", {"command": "cat raw.bin"})
    assert text.ok and "\\xff\\xfe" in text.text and "d" in text.text
    # A NUL in a command cannot end it early or inject a second one.
    injected = await sb.bash("echo safe\x00; echo injected")
    assert injected.exit_code == 0 and "safe" in injected.output

    out = await sb.ipython("print('n\\x00ul'); import os; os.write(1, b'\\xff\\xfe raw fd\\n')")
    assert "n\x00ul\n" in out.stdout and "\ufffd\ufffd raw fd" in out.stdout and out.error in ("", None)
    # A lone surrogate reaches the kernel's wire as invalid UTF-8: replaced, not fatal.
    lone = await sb.ipython("print('bad \\udcff surrogate')")
    assert lone.stdout == "bad \ufffd surrogate\n"
    value = await sb.ipython("b'\\x00\\xff' + bytes(range(3))")
    assert value.result == "b'\\x00\\xff\\x00\\x01\\x02'"
    assert (await sb.ipython("'ok'")).result == "'ok'"
    # The editor refuses binary files with a clear message rather than mangling them.
    with pytest.raises(ToolError, match="not UTF-8"):
        await sb.edit("view", "raw.bin")


async def test_malformed_and_crashing_tool_calls_get_clear_errors_and_the_sandbox_keeps_serving(sb, sandbox):
    bad_calls = [
        ("bash", {"command": 42}, "command"),
        ("write_file", {"path": "x.txt"}, "data"),  # a KeyError inside the supervisor
        ("read_file", {"path": "nope.txt"}, "does not exist"),
        ("edit", {"command": "view", "path": "x", "view_range": "oops"}, "view_range|does not exist"),
        ("edit", {"command": "create", "path": "", "file_text": "x"}, "path is empty"),
        ("ipython", {"code": None}, "code"),
        ("no_such_op", {}, "unknown op"),
    ]
    for op, args, expected in bad_calls:
        with pytest.raises(ToolError, match=expected):
            await sb.request(op, **args)
    for name, arguments in [("bash", '{"command": "ls", '), ("editor", '"just a string"'), ("bash", "\x00\xff")]:
        output = await sb.call_tool(name, arguments)
        assert not output.ok and output.text.startswith("Error:")

    # Garbage on the socket: the connection is dropped, the supervisor lives on.
    for garbage in [b"\xff" * 64, b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", (2**31).to_bytes(4, "big") + b"x"]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(sandbox.socket_path)
            raw.sendall(garbage)
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(10)
            try:
                while raw.recv(4096):
                    pass
            except ConnectionResetError:
                pass  # dropped with our garbage unread: as good as a close
    async with SandboxClient(sandbox.socket_path) as fresh:
        assert (await fresh.bash("echo still serving")).output == "still serving\n"
    assert (await sb.bash("echo same connection")).output == "same connection\n"
    assert protocol.MAX_FRAME_BYTES < 2**31


@pytest.fixture
def host_redis():
    """A redis-server listening on TCP and on a Unix socket at a path the sandbox's rootfs shows."""
    folder = tempfile.mkdtemp(prefix="rs-redis-host-", dir="/var/tmp")
    sock_path = os.path.join(folder, "redis.sock")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", sock_path,
         "--unixsocketperm", "777", "--save", "", "--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(250):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    pass
                if os.path.exists(sock_path):
                    break
            except OSError:
                pass
            server.poll()
            assert server.returncode is None, "redis-server exited at start"
            import time

            time.sleep(0.02)
        yield sock_path, port
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


REDIS_PROBE = """
import socket, sys
def ping(family, address):
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            s.connect(address)
            s.sendall(b"PING\\r\\n")
            return "REACHED " + s.recv(64).decode(errors="replace").strip()
    except OSError as error:
        return "FAILED " + type(error).__name__
print(ping(socket.AF_UNIX, sys.argv[1]))
print(ping(socket.AF_INET, ("127.0.0.1", int(sys.argv[2]))))
"""


async def test_the_hosts_redis_is_unreachable_by_unix_socket_and_tcp(root_dir, host_redis):
    sock_path, port = host_redis
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="noredis", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            await sb.write_file("probe.py", REDIS_PROBE)
            result = await sb.bash(f"python3 probe.py {sock_path} {port}")
            unix_line, tcp_line = result.output.splitlines()
            assert unix_line.startswith("FAILED") and tcp_line.startswith("FAILED"), result.output
            # The host itself reaches both, so the probe would have told.
            with socket.socket(socket.AF_UNIX) as direct:
                direct.connect(sock_path)
    finally:
        await destroy_sandbox(handle)


async def test_a_socket_masked_at_creation_that_disappears_does_not_break_new_shells(root_dir):
    folder = tempfile.mkdtemp(prefix="rs-gone-", dir="/var/tmp")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(folder, "service.sock"))
    listener.listen(1)
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="gone", root_dir=root_dir)
    try:
        listener.close()
        shutil.rmtree(folder)
        async with SandboxClient(handle.socket_path) as sb:
            assert (await sb.bash("echo new shell", session="later")).output == "new shell\n"
            assert (await sb.ipython("1 + 1")).result == "2"
    finally:
        await destroy_sandbox(handle)
        shutil.rmtree(folder, ignore_errors=True)


async def test_many_hostile_calls_at_once_leave_the_sandbox_serving(sb):
    calls = [sb.bash("cat /dev/urandom | head -c 3000000", session=f"s{i}", timeout_s=30) for i in range(4)]
    calls += [sb.request("write_file", path="../../x", data=b"x") for _ in range(4)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(r.truncated for r in results[:4])
    assert all(isinstance(r, ToolError) and "outside" in str(r) for r in results[4:])
    assert (await sb.bash("echo fine")).output == "fine\n"
