"""The launcher of a harness inside its sandbox, and the relay from the sandbox's own loopback to
the job's door. Runs in the sandbox as ``python3 -S door_relay.py LAUNCH.json`` (the stdlib only:
every image has a python3; agent/sandbox_harness.py copies this file in), so it imports nothing of
rollstream.

It reads the launch file (and removes it: the job's key is in it), listens on 127.0.0.1:PORT of
the sandbox's network namespace (network off: only its own loopback), starts the harness's
command with ``{door_port}`` in its arguments and environment replaced by PORT, and relays every
connection to the job's door socket (bound into this sandbox alone), sending the key first: the
harness itself holds only a placeholder key. It exits with the harness's exit status once the
harness exits (whatever it left behind is killed with the sandbox's session)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

PREAMBLE = b"ROLLSTREAM-DOOR "  # agent/gateway.py SANDBOX_PREAMBLE
CHUNK = 65536


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(CHUNK)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client: socket.socket, door_socket: str, key: bytes) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(door_socket)
        upstream.sendall(PREAMBLE + key + b"\n")
    except OSError as error:
        body = json.dumps({"error": {"message": f"the job's door is closed ({error.strerror}); the job has ended",
                                     "type": "server_error", "code": "door_closed"}}).encode()
        try:
            client.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        except OSError:
            pass
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _serve(listener: socket.socket, door_socket: str, key: bytes) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_relay, args=(client, door_socket, key), daemon=True).start()


def _with_port(value: str, port: int) -> str:
    return value.replace("{door_port}", str(port))


def _undumpable() -> None:
    """Keep the key out of reach of the harness (our child, same uid): /proc/PID/mem and environ
    of a non-dumpable process need CAP_SYS_PTRACE, which no sandbox has."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except (ImportError, OSError, AttributeError):
        pass  # an image without ctypes: the key is then as safe as the harness's own memory


def main(launch_path: str) -> int:
    _undumpable()
    with open(launch_path) as handle:
        launch = json.load(handle)
    os.unlink(launch_path)  # the key lives on in this process's memory alone
    key = launch["key"].encode()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    threading.Thread(target=_serve, args=(listener, launch["socket"], key), daemon=True).start()
    env = dict(os.environ)  # the sandbox's environment, and the preset's on top
    env.update({name: _with_port(value, port) for name, value in launch["env"].items()})
    argv = [_with_port(arg, port) for arg in launch["argv"]]
    try:
        child = subprocess.Popen(argv, env=env, cwd=launch.get("cwd"), stdin=subprocess.DEVNULL)
    except OSError as error:
        print(f"rollstream: cannot start the harness {argv[0]!r}: {error.strerror}; is the preset installed in "
              "this sandbox's image? (rollstream harnesses list)", file=sys.stderr, flush=True)
        return 127
    status = child.wait()
    sys.stdout.flush()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    os._exit(main(sys.argv[1]))
