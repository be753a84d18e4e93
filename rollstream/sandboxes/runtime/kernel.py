"""The IPython tool: one Jupyter kernel per sandbox, started inside it on first use.

The kernel runs in the sandbox (same rootfs, workdir and limits as bash) and talks ipc
through a host folder bound into the sandbox; jupyter_client is imported only here and
only when the kernel is first needed, so sandboxes that never use Python start fast.
That folder is the sandbox's (its code may plant anything there): the supervisor, root on
the host, reaches into it only through a descriptor of the folder, never by a path an entry
could redirect (`ConnectionFolder`).
"""

from __future__ import annotations

import hmac
import json
import os
import re
import resource
import secrets
import stat
import subprocess
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

from_package = bool(__package__)
if from_package:
    from .bash_session import SessionBusy
    from .child_processes import OutputCollector, join_cgroups, kill_session_processes
    from .start_slots import StartSlots, StartSlotsBusy
else:  # run as a script by the supervisor (python -S supervisor.py)
    from bash_session import SessionBusy
    from child_processes import OutputCollector, join_cgroups, kill_session_processes
    from start_slots import StartSlots, StartSlotsBusy

def _loads(data: bytes) -> dict:
    """JSON of a kernel message; undecodable bytes (a print of a lone surrogate) become U+FFFD."""
    try:
        return json.loads(data)
    except UnicodeDecodeError:
        return json.loads(data.decode("utf-8", "replace"))


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_POLL_S = 0.25
CONNECTION_FILE = "kernel.json"
# The kernel's ipc sockets are `k-PORT` in the connection folder; we use shell, iopub and control.
SOCKET_PREFIX = "k"
_PORTS = {"shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5}
_CONNECTED_PORTS = (1, 2, 4)


class KernelStartError(RuntimeError):
    """The kernel process did not come up inside the sandbox."""


class ConnectionFolder:
    """The host side of the folder the kernel shares with us, which the sandbox can write.

    Everything goes through a descriptor of the folder, without following an entry's symlink:
    the connection file is created afresh (O_EXCL | O_NOFOLLOW: one the sandbox planted, a
    symlink to /etc/passwd, is removed first and never opened), and the kernel's sockets are
    opened as O_PATH descriptors that must be sockets, then connected through /proc/self/fd/N,
    which names that very inode. A socket path a zmq reconnect would follow again later
    cannot be swapped for a symlink to a host socket (Redis, the container engine).
    """

    def __init__(self, host_dir: str) -> None:
        self.host_dir = host_dir
        # The folder itself sits in the sandbox's own folder, which the sandbox cannot write.
        self.fd = os.open(host_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.socket_fds: dict[int, int] = {}

    def write_connection_file(self, info: dict) -> None:
        """`kernel.json`, a new file of ours whatever the sandbox left under that name."""
        data = json.dumps(info).encode()
        for _ in range(3):
            self._remove(CONNECTION_FILE)
            for port in _PORTS.values():
                self._remove(f"{SOCKET_PREFIX}-{port}")
            try:
                fd = os.open(CONNECTION_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             0o644, dir_fd=self.fd)
            except FileExistsError:
                continue  # made again in between, by something running in the sandbox
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        raise KernelStartError(
            f"something in the sandbox keeps recreating {CONNECTION_FILE} in the kernel's folder; "
            "stop it (or restart the sandbox) and run the cell again"
        )

    def _remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)  # unlinkat: a symlink goes, not what it names
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise KernelStartError(
                f"the kernel's folder in the sandbox holds a folder named {name}; remove it and run the cell again"
            ) from None

    def socket_addresses(self) -> dict[int, str] | None:
        """zmq addresses of the kernel's sockets once it has bound them all, else None."""
        for port in _CONNECTED_PORTS:
            if port in self.socket_fds:
                continue
            try:
                fd = os.open(f"{SOCKET_PREFIX}-{port}", os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
            except FileNotFoundError:
                return None
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                self.socket_fds[port] = fd
            else:  # not bound yet (the kernel's bind replaces what was planted there), or never
                os.close(fd)
                return None
        return {port: f"ipc:///proc/self/fd/{fd}" for port, fd in self.socket_fds.items()}

    def close(self) -> None:
        for fd in [*self.socket_fds.values(), self.fd]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.socket_fds = {}


class Kernel:
    """A kernel process inside the sandbox and our zmq sockets to it on the host side."""

    def __init__(
        self,
        exec_prefix: list[str],
        kernel_argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        rlimits: dict[str, int],
        host_dir: str,
        inner_dir: str,
        output_bytes: int,
        log_path: str,
        start_timeout_s: float = 60.0,
        interrupt_grace_s: float = 3.0,
        spawner=None,
        cgroup_procs: list[str] | None = None,
        start_slots_dir: str | None = None,
        start_queue_s: float = 300.0,
        slot_hold_s: float = 10.0,
    ) -> None:
        self.exec_prefix = exec_prefix
        self.kernel_argv = kernel_argv
        self.env = env
        self.cwd = cwd
        self.rlimits = rlimits
        self.host_dir = host_dir
        self.inner_dir = inner_dir
        self.output_bytes = output_bytes
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.interrupt_grace_s = interrupt_grace_s
        self.spawner = spawner or (lambda function: function())
        self.cgroup_procs = cgroup_procs or []
        # The node's kernels start a few at a time (start_slots.py); a start waits its turn at
        # most start_queue_s, and its own start_timeout_s only begins with its turn.
        self.start_slots = StartSlots(start_slots_dir) if start_slots_dir else None
        self.start_queue_s = start_queue_s
        # A start keeps its slot at most this long: the sandbox's own code can make a start slow
        # (an IPython startup script in its /tmp), and must not hold back other sandboxes' kernels.
        self.slot_hold_s = slot_hold_s
        self._slot: int | None = None
        self._slot_until = 0.0
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.context: zmq.Context | None = None
        self.folder: ConnectionFolder | None = None
        self._cached_poller = None

    # -- lifecycle -------------------------------------------------------------------
    def _preexec(self) -> None:
        join_cgroups(self.cgroup_procs)
        for name, value in self.rlimits.items():
            resource.setrlimit(getattr(resource, name), (value, value))

    def start(self) -> None:
        if self.start_slots is None:
            self._start()
            return
        try:
            self._slot = self.start_slots.acquire(self.start_queue_s)
        except StartSlotsBusy as error:
            raise KernelStartError(str(error)) from None
        except OSError:  # a root we cannot lock in (read-only, odd filesystem): start unpaced
            self._start()
            return
        self._slot_until = time.monotonic() + self.slot_hold_s
        try:
            self._start()
        finally:
            self._release_slot()

    def _release_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            StartSlots.release(slot)

    def _start(self) -> None:
        if not os.path.isdir(self.host_dir):
            os.makedirs(self.host_dir)
        self.folder = ConnectionFolder(self.host_dir)
        key = secrets.token_hex(16)
        info = dict(_PORTS, transport="ipc", key=key, signature_scheme="hmac-sha256", kernel_name="python3")
        # Host and sandbox see the same folder under different paths: the kernel gets the
        # sandbox path, we connect through the folder's descriptor.
        try:
            self.folder.write_connection_file(dict(info, ip=os.path.join(self.inner_dir, SOCKET_PREFIX)))
        except BaseException:
            self.close()
            raise
        argv = [a.replace("{connection_file}", os.path.join(self.inner_dir, CONNECTION_FILE))
                for a in self.kernel_argv]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the kernel process, closed below
        try:
            self.process = self.spawner(
                lambda: subprocess.Popen(
                    self.exec_prefix + argv,
                    env=self.env,
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    preexec_fn=self._preexec if self.rlimits or self.cgroup_procs else None,
                )
            )
        finally:
            log.close()
        # Imported while the kernel boots: jupyter_client takes a few hundred ms to import.
        # We drive the zmq sockets ourselves; the blocking client adds ms per message.
        import zmq
        from jupyter_client.session import Session

        self.zmq = zmq
        self.session = Session(key=key.encode(), signature_scheme="hmac-sha256", username="rollstream")
        self.context = zmq.Context()
        self.shell = self.context.socket(zmq.DEALER)
        self.control = self.context.socket(zmq.DEALER)
        self.iopub = self.context.socket(zmq.SUB)
        self.iopub.setsockopt(zmq.SUBSCRIBE, b"")
        for sock in (self.shell, self.iopub, self.control):
            sock.linger = 0
        self._wait_ready(time.monotonic() + self.start_timeout_s)

    def _connect(self) -> bool:
        """Connect to the kernel's sockets once it has bound them; False while it has not."""
        assert self.folder is not None
        addresses = self.folder.socket_addresses()
        if addresses is None:
            return False
        for sock, port in ((self.shell, 1), (self.iopub, 2), (self.control, 4)):
            sock.connect(addresses[port])
        return True

    def _wait_ready(self, deadline: float) -> None:
        """Send kernel_info until its status reaches us on iopub (so no output is lost)."""
        assert self.process is not None
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.iopub, zmq.POLLIN)
        poller.register(self.shell, zmq.POLLIN)
        pending: set[str] = set()
        next_send = 0.0
        connected = False
        while True:
            now = time.monotonic()
            if self._slot is not None and now > self._slot_until:
                self._release_slot()
            if self.process.poll() is not None:
                code = self.process.returncode
                self.close()
                raise KernelStartError(
                    f"the IPython kernel exited with status {code} while starting; is ipykernel "
                    f"installed in the sandbox image? see {self.log_path}"
                )
            if now > deadline:
                self.close()
                raise KernelStartError(
                    f"the IPython kernel did not answer within {self.start_timeout_s:g} s; see {self.log_path}"
                )
            if not connected:
                connected = self._connect()
                if not connected:
                    time.sleep(0.005)
                    continue
            if now >= next_send:
                message = self.session.msg("kernel_info_request", content={})
                self.session.send(self.shell, message)
                pending.add(message["header"]["msg_id"])
                next_send = now + 0.5
            for sock, _ in poller.poll(100):
                reply = self.session.recv(sock, mode=zmq.NOBLOCK)[1]
                if sock is self.iopub and reply and reply["parent_header"].get("msg_id") in pending:
                    self._drain(0.05)
                    return

    def _drain(self, wait_s: float) -> None:
        """Discard stale replies (earlier kernel_info, interrupted cells)."""
        zmq = self.zmq
        for sock in (self.shell, self.iopub, self.control):
            while sock.poll(int(wait_s * 1000)):
                sock.recv_multipart(zmq.NOBLOCK)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def close(self, kill_session: bool = True) -> None:
        """Stop the kernel; kill_session=False when the caller already killed its session."""
        context = getattr(self, "context", None)
        if context is not None:
            for sock in (self.shell, self.iopub, self.control):
                sock.close(linger=0)
            context.term()
            self.context = None
            self._cached_poller = None
        if self.folder is not None:
            self.folder.close()
            self.folder = None
        process, self.process = self.process, None
        if process is not None:
            if kill_session:
                kill_session_processes(process.pid)
            try:
                process.kill()
            except ProcessLookupError:
                pass
            process.wait()

    # -- the tool --------------------------------------------------------------------
    def execute(self, code: str, timeout_s: float) -> dict:
        if not self.lock.acquire(blocking=False):
            raise SessionBusy("the IPython kernel is still running a cell; wait for it to finish")
        try:
            return self._execute(code, timeout_s)
        finally:
            self.lock.release()

    def _execute(self, code: str, timeout_s: float) -> dict:
        started = time.monotonic()
        notes: list[str] = []
        if not self.alive:
            if self.process is not None:
                notes.append("the kernel had died and was restarted; its state is lost")
            self.close()
            self.start()
            # The cell's time runs from a kernel ready for it: a start that waited its turn on a
            # busy node does not eat the cell's timeout.
            cell_started = time.monotonic()
        else:
            cell_started = started
        request = self.session.msg(
            "execute_request",
            content={"code": code, "silent": False, "store_history": True, "user_expressions": {},
                     "allow_stdin": False, "stop_on_error": True},
        )
        self.session.send(self.shell, request)
        msg_id = request["header"]["msg_id"]
        out = {"stdout": OutputCollector(self.output_bytes), "stderr": OutputCollector(self.output_bytes)}
        result: dict = {"result": None, "error": None, "images_png_b64": [], "execution_count": None}
        finished = self._collect(msg_id, cell_started + timeout_s, out, result)
        timed_out = not finished
        interrupted = False
        if timed_out:
            interrupted = True
            notes.append(f"cell timed out after {timeout_s:g} s and was interrupted")
            self._send_interrupt()
            if not self._collect(msg_id, time.monotonic() + self.interrupt_grace_s, out, result):
                self.close()
                notes.append("the kernel ignored the interrupt and was restarted; its state is lost")
        elif not self.alive:
            notes.append("the kernel died while running the cell; the next cell starts a new one")
        return {
            "stdout": out["stdout"].render().decode("utf-8", "replace"),
            "stderr": out["stderr"].render().decode("utf-8", "replace"),
            **result,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "truncated": out["stdout"].truncated or out["stderr"].truncated,
            "duration_ms": (time.monotonic() - started) * 1000.0,
            "note": "; ".join(notes),
        }

    def _collect(self, msg_id: str, deadline: float, out: dict, result: dict) -> bool:
        """Gather iopub messages of `msg_id` until the kernel goes idle; False on timeout.

        The idle status follows all of the cell's output, so it alone ends the wait; the
        execute_reply (which ipykernel routes through one more thread, a scheduler round
        on a busy node) is drained here, or with the next cell, and not waited for.
        """
        idle = False
        while not idle:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready = dict(self._poller().poll(int(min(remaining, _POLL_S) * 1000) + 1))
            if not ready:
                if not self.alive:
                    result["error"] = result["error"] or "KernelDied: the kernel process exited"
                    return True
                continue
            if self.shell in ready:
                self._recv(self.shell, msg_id)
            if self.iopub not in ready:
                continue
            message = self._recv(self.iopub, msg_id)
            if message is None:
                continue
            kind, content = message
            if kind == "stream":
                name = content.get("name") if content.get("name") in out else "stdout"
                out[name].add(content.get("text", "").encode("utf-8", "replace"))
            elif kind in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "image/png" in data:
                    result["images_png_b64"].append(data["image/png"].replace("\n", ""))
                if kind == "execute_result":
                    result["result"] = data.get("text/plain")
                    result["execution_count"] = content.get("execution_count")
                elif "text/plain" in data and "image/png" not in data:
                    out["stdout"].add((data["text/plain"] + "\n").encode("utf-8", "replace"))
            elif kind == "error":
                traceback = "\n".join(content.get("traceback", []))
                result["error"] = _ANSI.sub("", traceback) or f"{content.get('ename')}: {content.get('evalue')}"
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
        return True

    def _recv(self, sock, parent_id: str) -> tuple[str, dict] | None:
        """(msg_type, content) of the next message on `sock` if it answers `parent_id`.

        Session.recv parses every part and every date in it: most of a 1+1 cell's CPU
        time on our side. We check the signature and parse only what we read.
        """
        frames = sock.recv_multipart(self.zmq.NOBLOCK)
        try:
            start = frames.index(b"<IDS|MSG>") + 1
        except ValueError:
            return None
        signature, header, parent, metadata, content = frames[start : start + 5]
        if not hmac.compare_digest(self.session.sign([header, parent, metadata, content]), signature):
            return None  # not from our kernel: ignore it, as Session.recv would refuse it
        if _loads(parent).get("msg_id") != parent_id:
            return None
        return _loads(header)["msg_type"], _loads(content)

    def _poller(self):
        if getattr(self, "_cached_poller", None) is None:
            poller = self.zmq.Poller()
            poller.register(self.iopub, self.zmq.POLLIN)
            poller.register(self.shell, self.zmq.POLLIN)
            self._cached_poller = poller
        return self._cached_poller

    def _send_interrupt(self) -> None:
        # ipykernel answers interrupt_request on the control channel by signalling itself;
        # this works through any container runtime, unlike a host-side signal.
        self.session.send(self.control, self.session.msg("interrupt_request", content={}))
