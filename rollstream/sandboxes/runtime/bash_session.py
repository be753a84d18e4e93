"""A persistent bash on a pty, the supervisor's implementation of the bash tool.

Each command is sent as one `eval` of ANSI-C-quoted text, so any text (unclosed quotes,
heredocs, non-UTF-8 bytes) is one command; completion is a per-session marker that
PROMPT_COMMAND writes to the terminal with the exit code. The framing is invisible whatever
the agent does to the terminal: after each command the supervisor puts back the tool's
termios and window size on the pty (so `stty echo`, `stty sane`, raw mode or `stty cols 20`
never show the framing or reach the next command), the wrapper hands `$?` and `$_` of the
previous command to the next one, and interrupts signal the pty's foreground process group
(SIGINT, then SIGKILL, then a new shell) rather than type a Ctrl-C byte that `stty -isig`
or raw mode would turn into input. An interactive bash the agent starts inside the shell
gets the same setup, and its `exit` goes back to the outer shell. Behind a pty the
supervisor does not own (`docker exec -t` makes its own inside the container) it reaches
that pty through /proc where it can (on the container's host) and holds it the same way;
elsewhere the shell restores the modes itself with `stty` before each prompt, and an
interrupt's signal comes from a second shell started beside it (bash_terminal.py).
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
from collections.abc import Callable
from typing import Protocol, TypeVar

import ptyprocess

if __package__:
    from .bash_framing import AFTER_MARKER, MARKER_PAYLOAD, SETUP, ansi_c_quote, encode_command, strip_trace
    from .bash_terminal import DIMENSIONS, ContainerTerminal, Terminal, reach_container_terminal, signal_from_beside
    from .bash_terminal import tool_modes
    from .child_processes import OutputCollector, join_cgroups, kill_session_processes
else:  # python -S supervisor.py: sibling modules are top-level
    from bash_framing import AFTER_MARKER, MARKER_PAYLOAD, SETUP, ansi_c_quote, encode_command, strip_trace
    from bash_terminal import DIMENSIONS, ContainerTerminal, Terminal, reach_container_terminal, signal_from_beside
    from bash_terminal import tool_modes
    from child_processes import OutputCollector, join_cgroups, kill_session_processes


_STARTUP_TIMEOUT_S = 15.0
# While a command that may `exec` or start `bash` runs quiet: how often to look whether a
# new bash, which prints no marker, has replaced the shell or runs inside it.
_EXEC_POLL_S = 0.2
T = TypeVar("T")


class Caller(Protocol):
    """Who waits for a command: the supervisor's connection (its descriptor), and what to do
    once it sends more or this call turns slow (hand its reading to another thread)."""

    fd: int
    done: bool

    def busy(self) -> None: ...


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
        spawner: Callable[[Callable[[], T]], T] | None = None,
        cgroup_procs: list[str] | None = None,
        inside_namespace: str | None = None,
    ) -> None:
        """`inside_namespace`: the pid namespace the shell runs in behind a pty of someone
        else's (`docker exec -t`), as its engine names it ("pid:[N]"; never taken from the
        shell): then the shell's terminal is reached from here (bash_terminal.py). None:
        the shell restores its modes itself."""
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.rlimits = rlimits
        self.output_bytes = output_bytes
        self.interrupt_grace_s = interrupt_grace_s
        self.spawner = spawner or (lambda function: function())
        self.cgroup_procs = cgroup_procs or []
        self.inside_namespace = inside_namespace
        self.lock = threading.Lock()
        self.process: ptyprocess.PtyProcess | None = None
        self.number = 0
        self.token = os.urandom(6).hex().encode()
        # Its payload: bash_framing.MARKER_PAYLOAD (or "N:STATUS:r:FLAGS" where the shell is
        # being replaced by a new bash, errexit: see _setup_line).
        self.marker = re.compile(rb"\x1eRS" + self.token + rb":([^\x1e]{0,400})\x1e")
        self.terminal: Terminal | None = None  # known once the shell answered its setup
        self.shell: tuple[int, bytes] | None = None  # its process group and command line
        self.replaced = False
        self.xtrace = False  # the agent's `set -x` is in effect
        self.xtrace_on = False  # ... and still on in the shell (PROMPT_COMMAND saw it)
        self.last_status = 0
        # An interactive bash the agent started inside the shell: for each shell below it,
        # the number of the command that started it (its marker comes when the inner exits)
        # and its process group and command line.
        self.outer: list[tuple[int, tuple[int, bytes] | None]] = []
        self.inside_pid: int | None = None  # the shell's pid where it runs, behind a foreign pty

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

    def _marker_printf(self, payload: str, output: str) -> str:
        """A printf of the marker with `payload` (one word: each argument costs bash a few
        microseconds) to `output`; one simple command, which a DEBUG trap sees."""
        return f"\\builtin printf '\\036RS{self.token.decode()}:%s\\036' {payload} {output}"

    def _setup_line(self, output: str) -> str:
        """Prompt and traps of a new shell (its variables: bash_framing.SETUP).

        The marker goes to bash's own descriptor of the terminal (255, close-on-exec) or
        /dev/tty, so that an agent's `exec >file` does not swallow it. Behind a pty of
        someone else's the prompt command first restores the modes with stty (a fork per
        command: docker exec costs far more anyway). On an exit that errexit (`set -e`)
        causes, the EXIT trap reports the failed command and replaces the shell by a new
        bash in the same directory with the exported variables and the functions, rather
        than leave the agent with a fresh shell (as does an `exit` with a non-zero status
        while errexit is on: the trap cannot tell them apart).
        """
        if self.foreign:
            rows, cols = DIMENSIONS
            prompt = (
                f"__rs_x=$?; \\command stty sane -echo -onlcr -ixon rows {rows} cols {cols} 2>/dev/null; "
                + self._marker_printf(MARKER_PAYLOAD.replace("$?", "$__rs_x"), output)
                + AFTER_MARKER
            )
        else:
            prompt = self._marker_printf(MARKER_PAYLOAD, output) + AFTER_MARKER  # bash restores `$?` after
        on_exit = (
            "__rs_x=$?; if [[ $- == *e* ]]; then "
            + self._marker_printf('"$__rs_n:$__rs_x:r:$-"', output)
            + "; \\builtin declare -fx $(\\builtin compgen -A function) 2>/dev/null; "
            '\\builtin exec "${BASH:-bash}" --noediting --noprofile --norc -i; fi'
        )
        return (
            f"PROMPT_COMMAND={ansi_c_quote(prompt.encode())}; readonly PROMPT_COMMAND; "
            f"trap -- {ansi_c_quote(on_exit.encode())} EXIT"
        )

    def _spawn_pty(self) -> ptyprocess.PtyProcess:
        """A new shell on a pty of its own, started by the spawner thread."""
        return self.spawner(
            lambda: ptyprocess.PtyProcess.spawn(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                echo=False,
                preexec_fn=self._preexec,
                dimensions=DIMENSIONS,
            )
        )

    def start(self) -> None:
        self.process = self._spawn_pty()
        self.terminal = None
        self.outer = []
        self._setup_shell()

    def _setup_shell(self) -> None:
        """Set up the bash now reading the pty: a new one, one that replaced the shell, or
        one the agent started inside it (readline echoes this line: it goes unseen)."""
        assert self.process is not None
        self.number = 0
        self.replaced = False
        self.xtrace = self.xtrace_on = False
        self.last_status = 0
        fd = self.process.fd
        wanted = tool_modes(termios.tcgetattr(fd))
        first = (
            "PS1=''; PS2=''; PS4=''; set +H +o history +o emacs +o vi; unset HISTFILE; "
            + SETUP
            + f"PROMPT_COMMAND={ansi_c_quote(self._marker_printf(MARKER_PAYLOAD, '').encode())}\n"
        )
        os.write(fd, first.encode())
        collector = OutputCollector(1 << 16)
        status = self._read_until_marker(collector, 0, time.monotonic() + _STARTUP_TIMEOUT_S, None)
        if status[0] == "done" and self.terminal is None:
            # A pty that echoed our setup line is not ours: `docker exec -t` made its own
            # (echo and CRLF on) and reads our pty raw.
            if b"__rs_pre" in collector.render():
                status = self._reach_inside(collector)
            else:
                self.terminal = Terminal(fd, wanted)
        if status[0] == "done":
            assert self.terminal is not None
            self.terminal.restore()
            self.shell = self.terminal.foreground()
            finish = (
                f"if [[ -t 255 ]]; then {self._setup_line('>&255')}; "
                f"elif {{ : >/dev/tty; }} 2>/dev/null; then {self._setup_line('2>/dev/null >/dev/tty')}; "
                f"else {self._setup_line('')}; fi\n"
            )
            os.write(fd, finish.encode())
            collector = OutputCollector(1 << 16)
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
        if self.process is None:
            return False
        try:  # one waitid that reaps nothing (ptyprocess's isalive makes two waitpid calls)
            if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return True
        except ChildProcessError:
            pass
        return self.process.isalive()  # it has exited: let ptyprocess reap it and keep its status

    def _reach_inside(self, collector: OutputCollector) -> tuple[str, int | None]:
        """Behind `docker exec -t`: the shell's pid where it runs. With the namespace its
        engine named, its terminal, where the supervisor can reach it (on the container's
        host: then the pty is handled as one of our own); else the shell restores its modes
        with `stty` before each prompt and interrupts come from a second exec (_signal_inside).
        The pid is the shell's word, so it can only ever name a process of that namespace."""
        assert self.process is not None
        os.write(self.process.fd, b"\\builtin printf '\\036P%s\\036' \"$$\"\n")
        status = self._read_until_marker(collector, 0, time.monotonic() + _STARTUP_TIMEOUT_S, None)
        found = re.search(rb"\x1eP(\d+)\x1e", collector.render())
        self.inside_pid = int(found.group(1)) if found else None
        inside = None
        if self.inside_pid is not None and self.inside_namespace:
            inside = reach_container_terminal(self.inside_pid, self.inside_namespace)
        self.terminal = inside or Terminal(self.process.fd, None)
        return status

    @property
    def foreign(self) -> bool:
        """Behind a pty the supervisor does not hold (no modes of its own to put back): the
        shell restores them itself and interrupts come from beside it."""
        return self.terminal is None or self.terminal.modes is None

    @property
    def terminal_kind(self) -> str:
        """How the supervisor holds this shell's terminal, for `info`."""
        if self.terminal is None:
            return "not started"
        if self.foreign:
            return "another program's pty (the shell runs stty before each prompt)"
        if isinstance(self.terminal, ContainerTerminal):
            return "the pty of the program in between (docker exec -t), reached from the host"
        return "a pty of the supervisor's own"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def close(self, kill_session: bool = True) -> None:
        """End the shell; kill_session=False when the caller already killed its session."""
        process, self.process = self.process, None
        if process is None:
            return
        if self.terminal is not None:
            self.terminal.close()
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

    def _signal_inside(self, signum: int) -> bool:
        """Behind a pty of someone else's (`docker exec -t`): signal the shell's terminal's
        foreground job from a second shell started the same way (signal_from_beside)."""
        if self.inside_pid is None:
            return False
        return signal_from_beside(self._spawn_pty, self.inside_pid, signum, _STARTUP_TIMEOUT_S)

    # -- reading ---------------------------------------------------------------------
    def _completes(self, payload: bytes, number: int) -> int | None:
        """The exit status if the marker `payload` ends command `number`, else None (a stale
        marker). Takes in the shell's options and whether it is being replaced."""
        fields = payload.split(b":")
        if len(fields) == 5 and fields[2] == b"%d" % number:  # the epilogue ran: "N:STATUS[$-]"
            record = fields[3]
            digits = record.rstrip(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
            status = int(digits or b"0")
            self.xtrace = b"x" in record[len(digits) :] or b"x" in fields[4]
        elif len(fields) >= 4 and (fields[0] == b"%d" % number or not fields[0].isdigit()) and fields[1].isdigit():
            # It did not (a syntax error, an interrupt, `set -u`): the eval's own status. A
            # number that is not one is the agent's doing (it set __rs_n): this command's.
            status = int(fields[1])
            self.xtrace = b"x" in fields[-1]
        else:
            return None
        self.xtrace_on = b"x" in fields[-1]
        self.replaced = len(fields) == 4 and fields[2] == b"r"
        self.last_status = status
        return status

    def _read_until_marker(
        self,
        collector: OutputCollector,
        number: int,
        deadline: float,
        no_output_s: float | None,
        watch_bash: bool = False,
        caller: Caller | None = None,
    ) -> tuple[str, int | None]:
        """Read output into `collector` until the marker of command `number`.

        Returns ("done", exit_code), ("timeout", None), ("no_output", None), ("eof", None);
        ("outer", exit_code) where an inner bash exited and the one below it finished the
        command that started it; with `watch_bash` ("exec", None) once the shell has exec'd a
        new bash and ("inner", None) once it runs an interactive bash waiting at its prompt.
        `caller`: see run.
        """
        assert self.process is not None
        fd = self.process.fd
        watched = [fd] if caller is None or caller.done else [fd, caller.fd]
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
            ready, _, _ = select.select(watched, [], [], min(wait, _EXEC_POLL_S) if watch_bash else wait)
            if len(watched) > 1 and watched[1] in ready:
                assert caller is not None
                caller.busy()
                watched = [fd]
                if fd not in ready:
                    continue
            if not ready:
                if watch_bash and self.terminal is not None and self.terminal.replaced_by_bash(self.shell):
                    collector.add(pending)
                    return "exec", None
                if watch_bash and self.terminal is not None and self.terminal.bash_inside(self.shell):
                    collector.add(pending)
                    return "inner", None
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
                status = self._completes(match.group(1), number)
                if status is not None:
                    return "done", status
                if self.outer and self._completes(match.group(1), self.outer[-1][0]) is not None:
                    self.shell = self.outer.pop()[1]
                    return "outer", self.last_status
                # A marker of an earlier, interrupted command: its output is stale.
            data = data[start:]
            # Hold back a possible marker prefix (it starts with \x1e) until the next read.
            cut = data.rfind(b"\x1e", max(0, len(data) - 512))
            if cut == -1:
                collector.add(data)
                pending = b""
            else:
                collector.add(data[:cut])
                pending = data[cut:]

    # -- the tool --------------------------------------------------------------------
    def run(
        self,
        command: bytes,
        timeout_s: float,
        no_output_timeout_s: float | None,
        caller: Caller | None = None,
    ) -> dict:
        """Run `command`. With a `caller`, its descriptor is watched while the command runs,
        and `caller.busy()` called (once) when it becomes readable or the call turns slow
        (an interrupt, a new shell to set up)."""
        if not self.lock.acquire(blocking=False):
            raise SessionBusy(
                "this bash session is still running a command; wait for it, or pass another "
                "session name to run commands side by side"
            )
        try:
            return self._run(command, timeout_s, no_output_timeout_s, caller)
        finally:
            self.lock.release()

    def _run(
        self, command: bytes, timeout_s: float, no_output_timeout_s: float | None, caller: Caller | None
    ) -> dict:
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
        line, lean = encode_command(command, number, self.last_status, self.xtrace, self.xtrace_on)
        xtrace_before = self.xtrace
        os.write(self.process.fd, line)
        watch = not self.foreign and (b"exec" in command or b"bash" in command)
        status, exit_code = self._read_until_marker(
            collector, number, started + timeout_s, no_output_timeout_s, watch, caller
        )
        if caller is not None and (status != "done" or self.replaced):
            caller.busy()  # what follows may take seconds
        if status == "exec":
            self._setup_shell()
            status, exit_code = "done", 0
            notes.append(
                "the shell was replaced by a new bash (exec); it carries on in the same directory "
                "with the exported variables"
            )
        elif status == "inner":
            self.outer.append((number, self.shell))
            self._setup_shell()
            self.number = number  # the inner shell's commands go on counting: the outer's is pending
            status, exit_code = "done", 0
            notes.append(
                "an interactive bash started inside the shell; the next commands run in it, and "
                "`exit` goes back to the outer shell"
            )
        elif status == "outer":
            status = "done"
            notes.append("the inner bash exited; back in the outer shell")
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
        if self.replaced and self.process is not None:
            self._setup_shell()
            notes.append(
                "the shell exited with errexit (set -e) on; a new bash carries on in the same directory with "
                "the exported variables and the functions (set -e is off)"
            )
        output = collector.render()
        if lean and self.xtrace_on and not xtrace_before and status == "done" and self.process is not None:
            # Turned on where the framing could not see it coming: its trace printed. What
            # PROMPT_COMMAND traces after the marker is read away by one more line, which
            # turns xtrace off unseen (the next command turns it on again).
            output = strip_trace(output, number)
            os.write(self.process.fd, b"{ \\builtin set +x; } 2>&-\n")
            self._read_until_marker(OutputCollector(1 << 16), number, time.monotonic() + _STARTUP_TIMEOUT_S, None)
            self.xtrace, self.xtrace_on = True, False
        if self.terminal is not None and self.terminal.restore():
            # The command turned on "\n" -> "\r\n" (stty sane); a terminal shows both alike.
            output = output.replace(b"\r\n", b"\n")
        return {
            "output": output,
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

    def _signal_job(self, terminal: Terminal | None, signum: int) -> bool:
        """`signum` to the foreground job: from a shell beside it behind a pty we do not own, else through ours."""
        if self.foreign:
            return self._signal_inside(signum)
        assert terminal is not None  # known once the shell answered its setup, before any command
        return terminal.signal_foreground(signum)

    def _interrupt(self, collector: OutputCollector, number: int, notes: list[str]) -> int | None:
        """SIGINT to the foreground job, then SIGKILL, then a new shell; returns the exit code.

        A signal, not a typed Ctrl-C: with `stty -isig` or raw mode the byte would be input,
        glued to the next command. Behind a pty we do not own the signal is sent from a
        second shell beside the first (_signal_inside); only where that fails is Ctrl-C typed.
        """
        assert self.process is not None
        fd = self.process.fd
        terminal = self.terminal
        if not self._signal_job(terminal, signal.SIGINT):
            os.write(fd, b"\x03")
        grace = time.monotonic() + self.interrupt_grace_s
        status, exit_code = self._read_until_marker(collector, number, grace, None)
        if status in ("done", "outer"):
            return exit_code
        if status != "eof":
            if self._signal_job(terminal, signal.SIGKILL):
                notes.append("Ctrl-C was ignored, the foreground job was killed")
            grace = time.monotonic() + self.interrupt_grace_s
            status, exit_code = self._read_until_marker(collector, number, grace, None)
            if status in ("done", "outer"):
                return exit_code
        self.close()
        self.start()
        notes.append("the shell had to be restarted (cwd and env reset)")
        return None
