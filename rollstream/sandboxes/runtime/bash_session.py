"""A persistent bash on a pty, the supervisor's implementation of the bash tool.

Commands are sent as one `eval $'...'` line, so any text (unclosed quotes, heredocs,
non-UTF-8 bytes) is one command; completion is a per-session marker that PROMPT_COMMAND
prints with the exit code. Timeouts interrupt with Ctrl-C, then kill, then restart.
"""

from __future__ import annotations

import os
import re
import resource
import select
import signal
import termios
import threading
import time

import ptyprocess


# Keep escaped chunks well below the 4095-byte canonical-mode line limit of a tty.
_CHUNK_CHARS = 1000
_SAFE = re.compile(rb"[^\x20-\x26\x28-\x5b\x5d-\x7e]")
_STARTUP_TIMEOUT_S = 15.0


def ansi_c_tokens(command: bytes) -> list[str]:
    """Escape bytes for bash's $'...' quoting, one token per source byte run."""

    def escape(match: re.Match[bytes]) -> bytes:
        byte = match.group(0)[0]
        if byte == 0:
            return b""  # bash strings end at NUL; a NUL in a command is never meaningful
        return b"\\x%02x" % byte

    escaped = _SAFE.sub(escape, command).decode("ascii")
    # Split only between escapes so that a chunk never ends inside "\xHH".
    return re.findall(r"\\x[0-9a-f]{2}|[^\\]{1,256}", escaped)


def encode_command(command: bytes, number: int) -> bytes:
    """The input line(s) that run `command` as command `number` in the session."""
    chunks: list[str] = []
    current = ""
    for token in ansi_c_tokens(command):
        if len(current) + len(token) > _CHUNK_CHARS and current:
            chunks.append(current)
            current = ""
        current += token
    chunks.append(current)
    if len(chunks) == 1:
        return f"__rs_n={number}; eval $'{chunks[0]}'\n".encode()
    lines = [f"{{ __rs_n={number}; __rs_c=$'{chunks[0]}'"]
    lines += [f"__rs_c+=$'{chunk}'" for chunk in chunks[1:]]
    lines.append('eval "$__rs_c"; }')
    return ("\n".join(lines) + "\n").encode()


class OutputCollector:
    """Keeps the first and last `cap/2` bytes of a stream and counts the rest."""

    def __init__(self, cap_bytes: int) -> None:
        self.head_cap = max(cap_bytes // 2, 1)
        self.tail_cap = max(cap_bytes - self.head_cap, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            # Trim in batches so that a flood of small reads stays linear.
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > len(self.head) + min(len(self.tail), self.tail_cap)

    def render(self) -> bytes:
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail else b""
        elided = self.total - len(self.head) - len(tail)
        if elided <= 0:
            return bytes(self.head) + tail
        marker = f"\n[... {elided:,} bytes of output elided ...]\n".encode()
        return bytes(self.head) + marker + tail


def kill_session_processes(*session_ids: int) -> None:
    """SIGKILL every process in the sessions `session_ids` (a pty child and all it started).

    One pass over /proc however many sessions: a pass costs milliseconds on a busy node.
    """
    own_pid = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own_pid:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
            fields = stat[stat.rindex(b")") + 2 :].split()
            if int(fields[3]) in session_ids:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def join_cgroups(procs_files: list[str]) -> None:
    """Move the calling process into the sandbox's cgroups (see confine.py); runs before exec."""
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


class Spawner:
    """Starts child processes from one long-lived thread.

    bwrap --die-with-parent uses PR_SET_PDEATHSIG, which fires when the *thread* that
    forked the child exits; request threads are short-lived, this one is not.
    """

    def __init__(self) -> None:
        import queue

        self.requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="spawner").start()

    def _loop(self) -> None:
        while True:
            function, done, box = self.requests.get()
            try:
                box.append((True, function()))
            except BaseException as error:  # handed back to the calling thread
                box.append((False, error))
            done.set()

    def __call__(self, function: Callable[[], T]) -> T:  # noqa: F821
        done, box = threading.Event(), []
        self.requests.put((function, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


class SessionBusy(Exception):
    """A second command was sent to a session that is still running one."""


class BashSession:
    """One bash process on a pty; `run` executes a command and returns a result dict."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        rlimits: dict[str, int],
        output_bytes: int,
        interrupt_grace_s: float = 2.0,
        spawner: Callable[[Callable[[], T]], T] | None = None,  # noqa: F821 (typing not imported: startup time)
        cgroup_procs: list[str] | None = None,
    ) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.rlimits = rlimits
        self.output_bytes = output_bytes
        self.interrupt_grace_s = interrupt_grace_s
        self.spawner = spawner or (lambda function: function())
        self.cgroup_procs = cgroup_procs or []
        self.lock = threading.Lock()
        self.process: ptyprocess.PtyProcess | None = None
        self.number = 0
        self.token = os.urandom(6).hex().encode()
        self.marker = re.compile(rb"\x1eRS" + self.token + rb":(\d+):(\d+)\x1e")

    # -- lifecycle -------------------------------------------------------------------
    def _preexec(self) -> None:
        # Runs in the child with the pty as stdin: no echo (ptyprocess did that) and no
        # "\n" -> "\r\n", set here rather than by an `stty` process inside the sandbox.
        attributes = termios.tcgetattr(0)
        attributes[1] &= ~termios.ONLCR
        termios.tcsetattr(0, termios.TCSANOW, attributes)
        join_cgroups(self.cgroup_procs)
        for name, value in self.rlimits.items():
            limit = getattr(resource, name)
            resource.setrlimit(limit, (value, value))

    def start(self) -> None:
        self.process = self.spawner(
            lambda: ptyprocess.PtyProcess.spawn(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                echo=False,
                preexec_fn=self._preexec,
                dimensions=(50, 250),
            )
        )
        self.number = 0
        setup = (
            "PS1=''; PS2=''; PS4=''; set +H; set +o history; "
            "unset HISTFILE; __rs_n=0; "
            f"PROMPT_COMMAND='__rs_ec=$?; printf \"\\036RS%s:%s:%s\\036\" {self.token.decode()} "
            "\"$__rs_n\" \"$__rs_ec\"'; readonly PROMPT_COMMAND\n"
        )
        os.write(self.process.fd, setup.encode())
        collector = OutputCollector(4096)
        status = self._read_until_marker(collector, 0, time.monotonic() + _STARTUP_TIMEOUT_S, None)
        if status[0] != "done":
            output = collector.render().decode("utf-8", "replace")
            self.close()
            raise RuntimeError(
                f"bash did not start in the sandbox ({status[0]}): {output[-2000:]!r}; "
                f"command was {self.argv!r}"
            )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.isalive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def close(self, kill_session: bool = True) -> None:
        """End the shell; kill_session=False when the caller already killed its session."""
        process, self.process = self.process, None
        if process is None:
            return
        if kill_session:
            kill_session_processes(process.pid)
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            process.wait()
        except ptyprocess.PtyProcessError:
            pass
        # ptyprocess sleeps 0.1 s after closing by default; the process is already reaped.
        process.delayafterclose = 0
        process.delayafterterminate = 0
        try:
            process.close(force=True)
        except OSError:
            pass

    # -- reading ---------------------------------------------------------------------
    def _read_until_marker(
        self,
        collector: OutputCollector,
        number: int,
        deadline: float,
        no_output_s: float | None,
    ) -> tuple[str, int | None]:
        """Read output into `collector` until the marker of command `number`.

        Returns ("done", exit_code), ("timeout", None), ("no_output", None) or ("eof", None).
        """
        assert self.process is not None
        fd = self.process.fd
        pending = b""
        last_output = time.monotonic()
        while True:
            now = time.monotonic()
            wait = deadline - now
            reason = "timeout"
            if no_output_s is not None and last_output + no_output_s - now < wait:
                wait = last_output + no_output_s - now
                reason = "no_output"
            if wait <= 0:
                collector.add(pending)
                return reason, None
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                collector.add(pending)
                return "eof", None
            last_output = time.monotonic()
            data = pending + chunk
            start = 0
            for match in self.marker.finditer(data):
                collector.add(data[start : match.start()])
                start = match.end()
                if int(match.group(1)) == number:
                    return "done", int(match.group(2))
                # A marker of an earlier, interrupted command: its output is stale.
            data = data[start:]
            # Hold back a possible marker prefix (it starts with \x1e) until the next read.
            cut = data.rfind(b"\x1e", max(0, len(data) - 64))
            if cut == -1:
                collector.add(data)
                pending = b""
            else:
                collector.add(data[:cut])
                pending = data[cut:]

    # -- the tool --------------------------------------------------------------------
    def run(self, command: bytes, timeout_s: float, no_output_timeout_s: float | None) -> dict:
        if not self.lock.acquire(blocking=False):
            raise SessionBusy(
                "this bash session is still running a command; wait for it, or pass another "
                "session name to run commands side by side"
            )
        try:
            return self._run(command, timeout_s, no_output_timeout_s)
        finally:
            self.lock.release()

    def _run(self, command: bytes, timeout_s: float, no_output_timeout_s: float | None) -> dict:
        started = time.monotonic()
        notes: list[str] = []
        if not self.alive:
            restarted = self.process is not None
            self.close()
            self.start()
            if restarted:
                notes.append("the previous shell had exited; a new one was started (cwd and env reset)")
        assert self.process is not None
        self.number += 1
        number = self.number
        collector = OutputCollector(self.output_bytes)
        os.write(self.process.fd, encode_command(command, number))
        status, exit_code = self._read_until_marker(
            collector, number, started + timeout_s, no_output_timeout_s
        )
        timed_out = status in ("timeout", "no_output")
        interrupted = False
        if status == "eof":
            exit_code = self._exit_status()
            notes.append(f"the shell exited (status {exit_code}); the next command starts a new one")
        elif timed_out:
            interrupted = True
            if status == "timeout":
                notes.append(f"command timed out after {timeout_s:g} s and was interrupted")
            else:
                notes.append(
                    f"command produced no output for {no_output_timeout_s:g} s and was interrupted"
                )
            exit_code = self._interrupt(collector, number, notes)
        return {
            "output": collector.render(),
            "exit_code": exit_code,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "truncated": collector.truncated,
            "total_bytes": collector.total,
            "duration_ms": (time.monotonic() - started) * 1000.0,
            "note": "; ".join(notes),
        }

    def _exit_status(self) -> int | None:
        assert self.process is not None
        try:
            self.process.wait()
        except ptyprocess.PtyProcessError:
            pass
        return self.process.exitstatus

    def _interrupt(self, collector: OutputCollector, number: int, notes: list[str]) -> int | None:
        """Ctrl-C, then SIGKILL of the foreground job, then a new shell; returns the exit code."""
        assert self.process is not None
        fd = self.process.fd
        os.write(fd, b"\x03")
        grace = time.monotonic() + self.interrupt_grace_s
        status, exit_code = self._read_until_marker(collector, number, grace, None)
        if status == "done":
            return exit_code
        if status != "eof":
            try:
                foreground = os.tcgetpgrp(fd)
                os.killpg(foreground, signal.SIGKILL)
                notes.append("Ctrl-C was ignored, the foreground job was killed")
            except OSError:
                pass
            grace = time.monotonic() + self.interrupt_grace_s
            status, exit_code = self._read_until_marker(collector, number, grace, None)
            if status == "done":
                return exit_code
        self.close()
        self.start()
        notes.append("the shell had to be restarted (cwd and env reset)")
        return None
