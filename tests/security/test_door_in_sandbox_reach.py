"""Issue 29, item 2: a job's door reaches into its sandbox (a Unix socket in the sandbox's own door
folder, bound read-only into that sandbox alone) and nowhere else. Written from the attacker's
side with real bubblewrap sandboxes: code in another job's sandbox looks for the door where it
would be, at the host path, and on the host's loopback; a host process (root, as the workers)
connects to the socket without the key or with a wrong one, or after the job ended. Without the
door folder (before this change) there was no door in the sandbox at all; these tests hold that
the one now there is this job's alone."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from rollstream.agent.gateway import SANDBOX_PREAMBLE, Gateway
from rollstream.episode_settings import AgentSettings
from rollstream.llm.inference_client import VLLMClient
from rollstream.llm.session import LLMSession
from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
)

ANSWER_WITHIN_S = 20.0
INSIDE = "/run/rollstream-door/door.sock"

# Run inside a sandbox: connect to a Unix socket, send a preamble and GET /v1/models; print what came back.
PROBE = r'''
import json, socket, sys
path, preamble = sys.argv[1], sys.argv[2].encode()
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
try:
    s.connect(path)
except OSError as e:
    print(json.dumps({"connect": e.strerror})); sys.exit()
s.sendall(preamble + b"\n" + b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(json.dumps({"status": data.split(b" ", 2)[1].decode() if data else None}))
'''

TCP_PROBE = r'''
import json, socket, sys
try:
    socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10).close()
    print(json.dumps({"tcp": "connected"}))
except OSError as e:
    print(json.dumps({"tcp": e.strerror or str(e)}))
'''


@pytest.fixture(scope="module")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)


@pytest.fixture
async def two_sandboxes(sandbox_root):
    handles = [await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"job{i}", owner="test",
                                    root_dir=sandbox_root) for i in (1, 2)]
    clients = [await SandboxClient(h.socket_path).connect() for h in handles]
    yield list(zip(handles, clients))
    for handle, client in zip(handles, clients):
        await client.close()
        await destroy_sandbox(handle)


@pytest.fixture
async def gateway():
    gateway = await Gateway().start()
    yield gateway
    await gateway.aclose()


def _door(gateway: Gateway, tokenizer, job_id: str):
    session = LLMSession(VLLMClient(), job_id, backend_url="http://127.0.0.1:9", max_backend_attempts=1)
    return gateway.open(job_id, session, tokenizer, AgentSettings())


async def _probe(client: SandboxClient, script: str, *args: str) -> dict:
    await client.write_file("/tmp/probe.py", script)
    quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
    result = await client.bash(f"python3 /tmp/probe.py {quoted}", timeout_s=60)
    return json.loads(result.output.strip().splitlines()[-1])


def _folder(handle) -> str:
    return os.path.join(os.path.dirname(handle.socket_path), "door")


async def test_another_jobs_sandbox_finds_no_door_of_this_job_anywhere(two_sandboxes, gateway, tokenizer):
    (mine, my_client), (_other, other_client) = two_sandboxes
    door = _door(gateway, tokenizer, "job1")
    host_path = await gateway.open_in_sandbox(door, _folder(mine))
    preamble = (SANDBOX_PREAMBLE + door.key.encode()).decode()
    # The job's own sandbox reaches it (so the probes below can tell reachable from not).
    assert await _probe(my_client, PROBE, INSIDE, preamble) == {"status": "200"}
    # Another sandbox, even holding the key: no door in its own folder, none at the host path,
    # and the host's loopback (where the door's TCP server listens) is not its loopback.
    assert await _probe(other_client, PROBE, INSIDE, preamble) == {"connect": "No such file or directory"}
    assert await _probe(other_client, PROBE, host_path, preamble) == {"connect": "No such file or directory"}
    assert (await _probe(other_client, TCP_PROBE, str(gateway.port)))["tcp"] != "connected"


async def test_the_jobs_own_sandbox_without_the_key_is_refused(two_sandboxes, gateway, tokenizer):
    (mine, my_client), _ = two_sandboxes
    door = _door(gateway, tokenizer, "job1")
    await gateway.open_in_sandbox(door, _folder(mine))
    other = _door(gateway, tokenizer, "job2")  # a real key, of another job
    for preamble in ("", SANDBOX_PREAMBLE.decode() + "rs-guessed", SANDBOX_PREAMBLE.decode() + other.key):
        assert await _probe(my_client, PROBE, INSIDE, preamble) == {"status": "401"}
    assert door.requests == 0


async def _host_request(path: str, preamble: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(preamble + b"\nGET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
    finally:
        writer.close()


async def test_a_host_process_without_the_key_is_refused_on_the_sandbox_socket(sandbox_root, gateway, tokenizer):
    folder = os.path.join(sandbox_root, "door-host")
    os.makedirs(folder, mode=0o755)
    door = _door(gateway, tokenizer, "job1")
    path = await gateway.open_in_sandbox(door, folder)
    for preamble in (b"", b"GET /v1/models HTTP/1.1", SANDBOX_PREAMBLE + b"job1", SANDBOX_PREAMBLE + b"rs-x"):
        assert (await _host_request(path, preamble)).startswith(b"HTTP/1.1 401 ")
    assert (await _host_request(path, SANDBOX_PREAMBLE + door.key.encode())).startswith(b"HTTP/1.1 200 ")


async def test_the_sandbox_socket_is_gone_and_open_connections_cut_once_the_job_ends(sandbox_root, gateway, tokenizer):
    folder = os.path.join(sandbox_root, "door-ended")
    os.makedirs(folder, mode=0o755)
    door = _door(gateway, tokenizer, "job1")
    path = await gateway.open_in_sandbox(door, folder)
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(SANDBOX_PREAMBLE + door.key.encode() + b"\nGET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    await writer.drain()
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), ANSWER_WITHIN_S)).startswith(b"HTTP/1.1 200 ")
    gateway.close(door)  # the job ended; a process it left behind keeps its connection and tries again
    assert not os.path.exists(path)
    try:
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), ANSWER_WITHIN_S)
    except ConnectionResetError:  # cut: the door aborted the connection
        rest = b""
    assert b"HTTP/1.1 200 " not in rest  # (what came before is the first answer's body)
    writer.close()
    with pytest.raises(FileNotFoundError):
        await asyncio.open_unix_connection(path)
