"""The per-sandbox supervisor: a detached process that owns one sandbox and serves its tools.

Forked by the node's fork server (runtime/forkserver.py), or started as `python -S
supervisor.py PLAN.json READY_FD`, in its own session; it
starts the container (if the backend has one), keeps bash sessions and the IPython kernel,
answers framed msgpack requests on a Unix socket, and tears everything down on shutdown,
idle timeout or end of life. Imports only the stdlib, msgpack and ptyprocess.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .kernel import Kernel
    from .plan import Plan
if __package__:
    from . import confine, identity, protocol
    from .bash_session import BashSession, SessionBusy
    from .bash_terminal import container_pid_namespace
    from .child_processes import Spawner, kill_session_processes
    from .editor import Editor, EditorError, PathMap
    from .host_masks import MASK_RACE_RETRIES, without_vanished_masks
    from .standby_threads import HandOff, StandbyThreads
    from .unix_path import bind_unix
else:  # python -S supervisor.py: sibling modules are top-level
    import confine
    import identity
    import protocol
    from bash_session import BashSession, SessionBusy
    from bash_terminal import container_pid_namespace
    from child_processes import Spawner, kill_session_processes
    from editor import Editor, EditorError, PathMap
    from host_masks import MASK_RACE_RETRIES, without_vanished_masks
    from standby_threads import HandOff, StandbyThreads
    from unix_path import bind_unix

MAX_SESSIONS = 16
EDITOR_LOCK_WAIT_S = 30.0
# After a command during which forks failed at the process limit: how long to watch for more
# failures before deciding that nothing is still forking against the limit.
FORK_FAILURE_WINDOW_S = 0.1


class BadRequest(Exception):
    """A request the supervisor cannot act on; the message says how to fix it."""


class Supervisor:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.dir = plan["dir"]
        self.sessions: dict[str, BashSession] = {}
        self.sessions_lock = threading.Lock()
        self.kernel: Kernel | None = None
        self.kernel_lock = threading.Lock()
        self.paths = PathMap(plan["workdir_inner"], [(inner, host) for inner, host in plan["mounts"]])
        self.editor = Editor(self.paths, plan["output_bytes"])
        self.editor_lock = threading.Lock()
        self.started = time.monotonic()
        self.last_activity = time.monotonic()
        self.in_flight = 0
        self.activity_lock = threading.Lock()
        self.stopping = threading.Event()
        self.disk_exceeded = ""
        # Forks that failed at the process limit (pids.events) already told in a result: a
        # bomb left running by one command may hit the limit only after that command ended.
        self.limit_hits_told = 0
        self.confinement: confine.Confinement | None = None
        self.identity: identity.HostIdentity | None = None
        self.container_namespace: str | None = None  # where the engine says the shells run
        self.listener: socket.socket | None = None
        self.held_connections: list[socket.socket] = []
        self.spawner = Spawner()
        self.readers: StandbyThreads | None = None  # started with serving
        # Written to wake the accept loop at once on shutdown (a signal or the shutdown op).
        self.wake_read, self.wake_write = os.pipe()

    def stop(self) -> None:
        self.stopping.set()
        try:
            os.write(self.wake_write, b"x")
        except OSError:
            pass

    # -- startup -----------------------------------------------------------------------
    def start(self) -> None:
        # The pid file comes first: a supervisor killed from here on may leave a mounted tmpfs,
        # a cgroup or a container, and the reaper tears down at once only a sandbox whose
        # supervisor it can see is dead (one with no pid file may still be being created).
        with open(os.path.join(self.dir, "supervisor.pid"), "w") as handle:
            handle.write(str(os.getpid()))
        self.confinement = confine.Confinement.create(self.plan)
        if self.plan.get("unprivileged_via") and os.geteuid() == 0:
            self.identity = identity.allocate(self.plan["unprivileged_via"])
            identity.hand_over(self.plan, self.identity.uid)
            self.paths.owner = self.identity.uid
        if start_argv := self.plan.get("start_argv"):
            import subprocess

            completed = subprocess.run(start_argv, capture_output=True, env=self.plan["host_env"],
                                       timeout=self.plan.get("start_timeout_s") or 300.0)
            if completed.returncode != 0:
                raise RuntimeError(
                    f"starting the container failed ({completed.returncode}): "
                    f"{completed.stderr.decode('utf-8', 'replace')[-2000:]}"
                )
        if inspect_argv := self.plan.get("inspect_argv"):
            self.container_namespace = container_pid_namespace(inspect_argv, self.plan["host_env"])
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.plan["socket_path"]
        if os.path.exists(path):
            os.unlink(path)
        bind_unix(self.listener, path)
        os.chmod(path, 0o600)
        self.listener.listen(128)
        self.session("main")  # start the default shell now so the first call is fast

    def session(self, name: str) -> BashSession:
        with self.sessions_lock:
            existing = self.sessions.get(name)
            if existing is not None:
                return existing
            if len(self.sessions) >= MAX_SESSIONS:
                raise BadRequest(
                    f"this sandbox already has {MAX_SESSIONS} bash sessions; reuse one or close "
                    "one with close_session"
                )
            created = self._started_shell()
            self.sessions[name] = created
            return created

    def _started_shell(self) -> BashSession:
        """A started bash. The host paths the plan masks are checked just before bwrap runs,
        but one can still vanish before bwrap mounts over it (another service stopping right
        then) and bwrap fails: then the masks are planned again and the start retried."""
        for attempt in range(MASK_RACE_RETRIES + 1):
            masked = without_vanished_masks(self.plan["bash_argv"])
            shell = BashSession(
                self._as_sandbox_user(masked),
                self.plan["spawn_env"],
                self.plan["spawn_cwd"],
                self._rlimits(),
                self.plan["output_bytes"],
                spawner=self.spawner,
                cgroup_procs=self._cgroup_procs(),
                inside_namespace=self.container_namespace,
            )
            try:
                shell.start()
                return shell
            except RuntimeError:
                if attempt == MASK_RACE_RETRIES or without_vanished_masks(self.plan["bash_argv"]) == masked:
                    raise
        raise AssertionError("unreachable")

    def _sandbox_argv(self, argv: list[str]) -> list[str]:
        """How to start a sandboxed process: without masks of host paths gone since the plan,
        under the sandbox's own host uid where we are root."""
        return self._as_sandbox_user(without_vanished_masks(argv))

    def _as_sandbox_user(self, argv: list[str]) -> list[str]:
        return self.identity.wrap(argv, os.path.join(self.dir, "stage")) if self.identity else argv

    def _rlimits(self) -> dict[str, int]:
        """The plan's rlimits; RLIMIT_NPROC left out where the pids cgroup holds the process limit
        (under a sandbox uid it would count too, and fail forks before the cgroup can tell)."""
        if self.confinement is not None and "pids" in self.confinement.record["limits"]:
            return {k: v for k, v in self.plan["rlimits"].items() if k != "RLIMIT_NPROC"}
        return self.plan["rlimits"]

    def _cgroup_procs(self) -> list[str]:
        return self.confinement.join_files if self.confinement is not None else []

    def _disk_gate(self) -> None:
        """Refuse writes past a polled disk limit (a tmpfs limit answers ENOSPC by itself)."""
        if self.disk_exceeded and not (self.confinement and self.confinement.disk_on_tmpfs):
            raise BadRequest(self.disk_exceeded)

    # -- serving -----------------------------------------------------------------------
    def serve(self) -> None:
        assert self.listener is not None
        threading.Thread(target=self._watchdog, daemon=True, name="watchdog").start()
        self.readers = StandbyThreads("reader")
        while not self.stopping.is_set():
            readable, _, _ = select.select([self.listener.fileno(), self.wake_read], [], [])
            if self.wake_read in readable:
                break
            try:
                connection, _ = self.listener.accept()
            except OSError:
                break
            connection.settimeout(None)
            self.readers.run(self._connection, connection)

    def _connection(self, connection: socket.socket, write_lock: threading.Lock | None = None) -> None:
        """Read requests of one connection; slow ones run here while another thread reads on.

        Handing the reading over (rather than the request) keeps the request on the thread
        that is already awake: one scheduler wake-up less per tool call on a busy node; the
        reading goes to a thread already waiting (standby_threads.py), not a new one. A bash
        command hands it over only when the connection sends more while the command runs, or
        the call turns slow: most calls are one request at a time, and another thread woken
        for each costs it ~35 µs on two cores (the threads take turns at the GIL).
        """
        write_lock = write_lock or threading.Lock()
        hand_off: HandOff | None = None
        try:
            while not self.stopping.is_set():
                request = protocol.recv_message(connection)
                if request is None:
                    return
                op = request.get("op")
                if op == "shutdown":
                    self._handle(connection, write_lock, request)
                    # The caller learns that teardown is over when this connection closes,
                    # which happens when the process exits.
                    self.held_connections.append(connection)
                    return
                if op in ("ping", "info", "read_file", "write_file", "edit"):
                    self._handle(connection, write_lock, request)  # quick: answer inline
                    continue
                assert self.readers is not None
                hand_off = HandOff(self.readers, self._connection, connection, write_lock)
                if op != "bash":
                    hand_off.busy()
                self._handle(connection, write_lock, request, hand_off)
                if hand_off.done:
                    return
                # A bash call that nothing else on its connection waited for: this thread reads on.
        except (OSError, protocol.ProtocolError):
            return
        finally:
            handed_over = hand_off is not None and hand_off.done
            if not handed_over and connection not in self.held_connections:
                try:
                    connection.close()
                except OSError:
                    pass

    def _handle(
        self, connection: socket.socket, write_lock: threading.Lock, request: dict, hand_off: HandOff | None = None
    ) -> None:
        with self.activity_lock:
            self.in_flight += 1
        try:
            reply = {"id": request.get("id"), "ok": True, "result": self._dispatch(request, hand_off)}
        except (BadRequest, EditorError, SessionBusy) as error:
            reply = {"id": request.get("id"), "ok": False, "kind": type(error).__name__, "error": str(error)}
        except Exception as error:  # reported to the caller; the supervisor keeps serving
            import traceback

            reply = {
                "id": request.get("id"),
                "ok": False,
                "kind": type(error).__name__,
                "error": f"{error}\n{traceback.format_exc(limit=4)}",
            }
        finally:
            with self.activity_lock:
                self.in_flight -= 1
                self.last_activity = time.monotonic()
        try:
            with write_lock:
                protocol.send_message(connection, reply)
        except OSError:
            pass
        if request.get("op") == "shutdown":
            self.stop()

    def _dispatch(self, request: dict, hand_off: HandOff | None = None):
        op = request.get("op")
        args = request.get("args") or {}
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "bash":
            return self._bash(args, hand_off)
        if op == "ipython":
            return self._ipython(args)
        if op == "edit":
            if args.get("command") in ("create", "str_replace", "insert"):
                self._disk_gate()
            # Every editor call is bounded (regular files only, a deadline per call), so the lock
            # is short; a caller still never waits on it forever.
            if not self.editor_lock.acquire(timeout=EDITOR_LOCK_WAIT_S):
                raise BadRequest("another editor call in this sandbox is still running; try again")
            try:
                with _disk_full_as_bad_request():
                    args = dict(args)
                    return {"output": self.editor.run(args.pop("command", None), args.pop("path", ""), **args)}
            finally:
                self.editor_lock.release()
        if op == "write_file":
            self._disk_gate()
            host = self.paths.to_host(args["path"])
            with _disk_full_as_bad_request():
                mode = args.get("mode")
                self.paths.write_bytes(host, args["data"], None if mode is None else int(mode))
            return {"bytes": len(args["data"])}
        if op == "read_file":
            host = self.paths.to_host(args["path"])
            try:
                return {"data": self.paths.read_bytes(host, int(args.get("max_bytes") or -1))}
            except FileNotFoundError:
                raise BadRequest(f"{args['path']} does not exist in the sandbox") from None
        if op == "close_session":
            with self.sessions_lock:
                session = self.sessions.pop(args.get("session", ""), None)
            if session is not None:
                session.close()
            return {"closed": session is not None}
        if op == "info":
            return {
                "pid": os.getpid(),
                "sessions": sorted(self.sessions),
                "terminals": {name: session.terminal_kind for name, session in sorted(self.sessions.items())},
                "kernel_alive": bool(self.kernel and self.kernel.alive),
                "uptime_s": time.monotonic() - self.started,
                "disk_exceeded": self.disk_exceeded,
                "limits": self.confinement.describe(self.plan) if self.confinement else {},
            }
        if op == "shutdown":
            return {"stopping": True}
        raise BadRequest(
            f"unknown op {op!r}; this supervisor serves ping, bash, ipython, edit, write_file, "
            "read_file, close_session, info, shutdown"
        )

    def _bash(self, args: dict, hand_off: HandOff | None) -> dict:
        """`hand_off`: see _connection; called before anything that may take long (starting
        a shell, killing one), and by the session while the command runs."""
        command = args.get("command")
        if isinstance(command, str):
            command = command.encode("utf-8", "surrogateescape")
        if not isinstance(command, bytes):
            raise BadRequest("bash needs 'command' as a string")
        timeout_s = float(args.get("timeout_s") or self.plan["default_timeout_s"])
        no_output = args.get("no_output_timeout_s", self.plan["default_no_output_timeout_s"])
        name = str(args.get("session") or "main")
        existing = self.sessions.get(name)
        if hand_off is not None and (existing is None or not existing.alive):
            hand_off.busy()
        session = self.session(name)
        notes = []
        if self.confinement is not None and self.confinement.at_process_limit():
            if hand_off is not None:
                hand_off.busy()
            if self._kill_shell(session):
                # A fork bomb from an earlier command still holds every process slot.
                notes.append(self._limit_note("before this command"))
                self.limit_hits_told = self.confinement.pid_limit_hits()
        result = session.run(command, timeout_s, float(no_output) if no_output else None, hand_off)
        if self.confinement is not None and (hits := self.confinement.pid_limit_hits()) > self.limit_hits_told:
            runaway = self._forks_still_failing(hits)
            self.limit_hits_told = self.confinement.pid_limit_hits()
            if runaway and self._kill_shell(session):
                notes.append(self._limit_note("during this command"))
            else:
                notes.append(f"the sandbox reached its process limit ({self.plan.get('max_processes')}); forks failed")
        result["note"] = "; ".join(filter(None, [*notes, result["note"]]))
        if self.confinement is not None and self.confinement.disk_on_tmpfs:
            self.disk_exceeded = self.confinement.disk_full_note()  # one statvfs: say it now
        if self.disk_exceeded:
            result["note"] = "; ".join(filter(None, [result["note"], self.disk_exceeded]))
        return result

    def _forks_still_failing(self, hits: int) -> bool:
        """After forks failed at the limit: is something still forking against it? A fork
        bomb in the background keeps the sandbox at the limit, or dips below it and keeps
        failing forks; a burst that is over (a `make -j` that ran out of slots) does neither."""
        assert self.confinement is not None
        if self.confinement.at_process_limit():
            return True
        time.sleep(FORK_FAILURE_WINDOW_S)
        return self.confinement.at_process_limit() or self.confinement.pid_limit_hits() > hits

    def _kill_shell(self, session: BashSession) -> bool:
        """Kill a shell and all it started (its pid namespace, under bwrap), unless it is busy."""
        if not session.lock.acquire(blocking=False):
            return False
        try:
            session.close()
        finally:
            session.lock.release()
        assert self.confinement is not None
        self.confinement.wait_below_process_limit(2.0)  # killed processes exit asynchronously
        return True

    def _limit_note(self, when: str) -> str:
        return (
            f"the sandbox was at its process limit ({self.plan.get('max_processes')} processes) {when}: "
            "this shell and every process it started were killed (cwd and env reset)"
        )

    def _ipython(self, args: dict) -> dict:
        code = args.get("code")
        if not isinstance(code, str):
            raise BadRequest("ipython needs 'code' as a string")
        with self.kernel_lock:
            if self.kernel is None:
                # Loaded on first use: a supervisor started directly (no fork server) comes up
                # without it, and most sandboxes never run a cell.
                if __package__:
                    from .kernel import Kernel
                else:
                    from kernel import Kernel
                self.kernel = Kernel(
                    self._sandbox_argv(self.plan["exec_prefix"]),
                    self.plan["kernel_argv"],
                    self.plan["spawn_env"],
                    self.plan["spawn_cwd"],
                    self._rlimits(),
                    self.plan["kernel_dir_host"],
                    self.plan["kernel_dir_inner"],
                    self.plan["output_bytes"],
                    os.path.join(self.dir, "kernel.log"),
                    spawner=self.spawner,
                    cgroup_procs=self._cgroup_procs(),
                    start_slots_dir=os.path.dirname(self.dir),  # the node's sandbox root
                )
        return self.kernel.execute(code, float(args.get("timeout_s") or self.plan["default_timeout_s"]))

    # -- limits and shutdown -----------------------------------------------------------
    def _watchdog(self) -> None:
        idle_s = self.plan["idle_timeout_s"]
        lifetime_s = self.plan["max_lifetime_s"]
        disk_bytes = self.plan.get("disk_bytes")
        next_disk_check = 0.0
        while not self.stopping.wait(1.0):
            now = time.monotonic()
            with self.activity_lock:
                idle = self.in_flight == 0 and now - self.last_activity > idle_s
            if idle or now - self.started > lifetime_s:
                self.stop()
                return
            if self.confinement and self.confinement.disk_on_tmpfs:
                self.disk_exceeded = self.confinement.disk_full_note()  # one statvfs
            elif disk_bytes and now >= next_disk_check:
                next_disk_check = now + 5.0
                used = sum(_tree_bytes(host) for _, host in self.plan["mounts"])
                self.disk_exceeded = (
                    f"disk limit exceeded: the sandbox uses {used // 2**20} MiB of "
                    f"{disk_bytes // 2**20} MiB; delete files before writing more"
                    if used > disk_bytes
                    else ""
                )

    def shutdown(self) -> None:
        self.stopping.set()
        if self.listener is not None:
            self.listener.close()
        sessions = list(self.sessions.values())
        roots = [pid for pid in [s.pid for s in sessions] + [self.kernel and self.kernel.pid] if pid]
        if self.plan.get("pid_namespace"):
            # Each root is a bwrap whose pid namespace dies with it: no /proc scan needed.
            for pid in roots:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        else:
            # Everything this sandbox started, in one pass over /proc.
            kill_session_processes(os.getpid(), *roots)
        for session in sessions:
            session.close(kill_session=False)
        if self.kernel is not None:
            self.kernel.close(kill_session=False)
        if stop_argv := self.plan.get("stop_argv"):
            import subprocess

            subprocess.run(stop_argv, capture_output=True, env=self.plan["host_env"], timeout=120)
            kill_session_processes(os.getpid())  # what the container CLI left behind
        stuck = self.confinement.release() if self.confinement is not None else []
        if stuck:  # the reaper (or destroy_sandbox's teardown) retries from confinement.json
            print(f"supervisor: could not release {'; '.join(stuck)}", file=sys.stderr, flush=True)
        elif self.plan.get("remove_dir_on_exit", True):
            remove_tree(self.dir)
        else:
            try:
                os.unlink(self.plan["socket_path"])
            except FileNotFoundError:
                pass


class _disk_full_as_bad_request:
    """Turns ENOSPC / EDQUOT from a host-side write into an error that says what to do."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, _traceback) -> Literal[False]:
        if isinstance(error, OSError) and error.errno in (28, 122):  # ENOSPC, EDQUOT
            raise BadRequest(
                "no space left in the sandbox's disk (workdir and /tmp share its disk limit); "
                "delete files before writing more"
            ) from None
        return False


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def remove_tree(path: str) -> None:
    """rm -rf that also removes folders the sandboxed code made read-only."""
    import shutil

    def make_writable(function, failed_path, _excinfo):
        # chmod follows symlinks: one the sandbox planted must never hand a host file 0700.
        if os.path.islink(failed_path) or os.path.islink(os.path.dirname(failed_path)):
            return
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable)


def run(plan_path: str, ready_fd: int | None = None) -> None:
    """Serve the sandbox of `plan_path` until shutdown, then exit the process (never returns).

    `ready_fd` (default: the plan's) gets one line, "ok PID" once the socket listens or
    "error ..."; the fork server passes its client's connection here.
    """
    with open(plan_path) as handle:
        plan = json.load(handle)
    if ready_fd is None:
        ready_fd = int(plan["ready_fd"])
    supervisor = Supervisor(plan)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: supervisor.stop())
    try:
        supervisor.start()
    except Exception as error:
        os.write(ready_fd, f"error {error}\n".encode("utf-8", "replace"))
        supervisor.shutdown()
        os._exit(1)
    os.write(ready_fd, f"ok {os.getpid()}\n".encode())
    os.close(ready_fd)
    try:
        supervisor.serve()
    finally:
        supervisor.shutdown()
        os._exit(0)


def main() -> None:
    run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)


if __name__ == "__main__":
    main()
