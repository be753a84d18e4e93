"""The node's fork server: a prepared parent that forks sandbox supervisors on request.

Started once per sandbox root as `python -S forkserver.py ROOT_DIR` (detached, by the first
create_sandbox that finds none), it has already imported everything a supervisor needs, so
a new supervisor costs a fork instead of an interpreter start. It stays single-threaded
(forking a threaded process is unsafe), collects its children's exit status (no zombies,
whatever pid 1 does) and is a child subreaper for what they leave behind.

Wire protocol on ROOT_DIR/.forkserver.sock: one msgpack frame in (see runtime/protocol.py),
text lines out. `{"op": "spawn", "plan_path", "log_path", "cwd"}` answers "accepted\\n" and
then the supervisor's own ready line ("ok PID" / "error ..."), written by the child on
the same connection; `{"op": "ping"}` and `{"op": "stop"}` answer "ok PID\\n".
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gc
import os
import select
import signal
import socket
import sys
import time

if __package__:
    from . import protocol, supervisor
    from .unix_path import bind_unix
else:  # python -S forkserver.py: sibling modules are top-level
    import protocol
    import supervisor
    from unix_path import bind_unix

SOCKET_NAME = ".forkserver.sock"
LOCK_NAME = ".forkserver.lock"
PID_NAME = ".forkserver.pid"
LOG_NAME = ".forkserver.log"
# With no supervisor left, the server exits after this long without a request, so an
# unused node (or a test's throwaway root) does not keep a process around.
IDLE_EXIT_S = 300.0
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NAME = 15
_REQUEST_TIMEOUT_S = 5.0


def _preload() -> None:
    """Import what the first IPython call of every sandbox would otherwise import itself."""
    try:
        import zmq  # noqa: F401
        from jupyter_client.session import Session  # noqa: F401
    except Exception:  # no jupyter_client here: sandboxes import it (and fail) on first use
        pass
    if __package__:
        from . import confine, kernel  # noqa: F401
    else:
        import confine
        import kernel  # noqa: F401
    confine.hierarchies()  # found once here, inherited by every supervisor forked after


class ForkServer:
    def __init__(self, root_dir: str, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self.root_dir = os.path.abspath(root_dir)
        self.socket_path = os.path.join(self.root_dir, SOCKET_NAME)
        self.idle_exit_s = idle_exit_s
        self.children: set[int] = set()
        self.stopping = False
        self.last_request = time.monotonic()
        self.lock_fd = -1
        self.listener: socket.socket | None = None
        self.socket_inode = 0
        self.wake_read, self.wake_write = os.pipe()

    # -- startup ---------------------------------------------------------------------
    def acquire(self) -> bool:
        """Take the root's lock; False when another fork server holds it."""
        self.lock_fd = os.open(os.path.join(self.root_dir, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _bind(self) -> None:
        try:
            os.unlink(self.socket_path)  # left by a server that was killed: we hold the lock now
        except FileNotFoundError:
            pass
        if self.listener is not None:
            self.listener.close()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind_unix(self.listener, self.socket_path)
        os.chmod(self.socket_path, 0o600)
        self.listener.listen(256)
        self.socket_inode = os.stat(self.socket_path).st_ino

    def listen(self) -> None:
        self._bind()
        with open(os.path.join(self.root_dir, PID_NAME), "w") as handle:
            handle.write(str(os.getpid()))
        libc = ctypes.CDLL(None, use_errno=True)
        # Processes whose supervisor died (a bwrap, a container CLI) come to us, not to a
        # pid 1 that may never collect them.
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        for fd in (self.wake_read, self.wake_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd does the work
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_stop_signal)

    def _on_stop_signal(self, *_: object) -> None:
        self.stopping = True

    # -- serving ---------------------------------------------------------------------
    def serve(self) -> None:
        assert self.listener is not None
        preload_pending = True
        while True:
            self._reap()
            if self.stopping or self._should_exit():
                return
            # The first request is answered before the preload (below), which follows at once.
            timeout = 0.05 if preload_pending else 1.0
            try:
                watched: list[socket.socket | int] = [self.listener, self.wake_read]  # _bind may replace it
                readable, _, _ = select.select(watched, [], [], timeout)
            except InterruptedError:
                continue
            if self.wake_read in readable:
                try:
                    while os.read(self.wake_read, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self.listener in readable:
                self._accept()
            if preload_pending:
                # In the first lull or right after the first request (whose create does not wait
                # for it): a warm pool creates sandboxes back to back, and each supervisor forked
                # before this imports zmq and jupyter_client itself at its first cell, 14 MB of
                # its own instead of pages shared with us (bench/density.py).
                preload_pending = False
                _preload()
                # Children would otherwise copy every page of these modules the first time
                # their garbage collector walks them.
                gc.freeze()

    def _should_exit(self) -> bool:
        """Exit once no supervisor is left and the root is gone or we were idle too long."""
        try:
            socket_ok = os.stat(self.socket_path).st_ino == self.socket_inode
        except FileNotFoundError:
            socket_ok = False
        root_exists = os.path.isdir(self.root_dir)
        if not socket_ok and root_exists:
            self._bind()  # someone removed our socket from a live root: serve on
        if self.children:
            return False
        return not root_exists or time.monotonic() - self.last_request > self.idle_exit_s

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return
        self.last_request = time.monotonic()
        try:
            connection.settimeout(_REQUEST_TIMEOUT_S)
            request = protocol.recv_message(connection) or {}
            op = request.get("op")
            if op == "spawn":
                connection.sendall(b"accepted\n")
                self._spawn(connection, request)
            elif op in ("ping", "stop"):
                connection.sendall(f"ok {os.getpid()}\n".encode())
                self.stopping = op == "stop"
            else:
                connection.sendall(f"error unknown op {op!r}; use spawn, ping or stop\n".encode())
        except Exception as error:  # a bad request must not take the node's server down
            print(f"forkserver: dropped a request: {error!r}", file=sys.stderr, flush=True)
            try:
                connection.sendall(f"error the fork server dropped the request: {error!r}\n".encode())
            except OSError:
                pass
        finally:
            connection.close()

    def _spawn(self, connection: socket.socket, request: dict) -> None:
        for key in ("plan_path", "log_path", "cwd"):
            if not isinstance(request.get(key), str):
                raise ValueError(f"spawn needs {key!r} as a string")
        log_fd = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            pid = os.fork()
        except OSError as error:
            os.close(log_fd)
            connection.sendall(f"error the fork server could not fork: {error}\n".encode())
            return
        if pid == 0:
            self._become_supervisor(connection, request, log_fd)  # never returns
        os.close(log_fd)
        self.children.add(pid)

    def _become_supervisor(self, connection: socket.socket, request: dict, log_fd: int) -> None:
        try:
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(signum, signal.SIG_DFL)
            # Our lock must die with the server, not live on in its children.
            os.close(self.lock_fd)
            os.close(self.wake_read)
            os.close(self.wake_write)
            assert self.listener is not None
            self.listener.close()
            os.setsid()  # its own session, like a supervisor started by Popen
            # Its argv stays the fork server's; name it for ps -o comm, top and pkill -x.
            ctypes.CDLL(None).prctl(_PR_SET_NAME, b"rs-supervisor", 0, 0, 0)
            null_fd = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null_fd, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.close(null_fd)
            os.close(log_fd)
            os.chdir(request["cwd"])
            connection.settimeout(None)
            supervisor.run(request["plan_path"], connection.detach())
        except BaseException as error:  # report, never fall back into the server's loop
            try:
                os.write(connection.fileno(), f"error {type(error).__name__}: {error}\n".encode())
            except (OSError, ValueError):
                pass
        finally:
            os._exit(1)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            try:
                if os.stat(self.socket_path).st_ino == self.socket_inode:
                    os.unlink(self.socket_path)
            except FileNotFoundError:
                pass


def main() -> None:
    root_dir = sys.argv[1]
    ready_fd = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    idle_exit_s = float(sys.argv[3]) if len(sys.argv) > 3 else IDLE_EXIT_S
    server = ForkServer(root_dir, idle_exit_s)

    def report(line: str) -> None:
        if ready_fd >= 0:
            try:
                os.write(ready_fd, (line + "\n").encode())
                os.close(ready_fd)
            except OSError as error:
                if error.errno != errno.EBADF:
                    raise

    try:
        if not server.acquire():
            report("busy another fork server holds this root")
            os._exit(0)
        server.listen()
    except Exception as error:
        report(f"error {type(error).__name__}: {error}")
        os._exit(1)
    report(f"ok {os.getpid()}")
    try:
        server.serve()
    finally:
        server.close()
        os._exit(0)


if __name__ == "__main__":
    main()
