"""The bash tool's terminal, as the supervisor sees it from the pty's master side: the termios
the framing needs and putting them back after a command changed them, the window size, and
the pty's foreground job (signalled on an interrupt; a bash that replaced the shell or runs
inside it). Used by bash_session.py.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable

import ptyprocess

DIMENSIONS = (50, 250)
_WINSIZE = struct.pack("HHHH", *DIMENSIONS, 0, 0)  # struct winsize
# A buffer for the kernel's struct termios (36 bytes on x86-64): one ioctl and a bytes
# comparison per command, where tcgetattr builds a list of 32 objects.
_TERMIOS_BUFFER = bytes(64)
# bash options that take the next argument: `bash -o vi` is interactive, `bash FILE` is not.
_BASH_OPTIONS_WITH_ARGUMENT = {b"--rcfile", b"--init-file", b"-o", b"+o", b"-O", b"+O"}
# Control characters of a fresh Linux tty (INIT_C_CC): an agent's `stty eol x` must not turn
# a byte of the next command into a line end.
_DEFAULT_CC = {
    termios.VINTR: 0x03, termios.VQUIT: 0x1C, termios.VERASE: 0x7F, termios.VKILL: 0x15,
    termios.VEOF: 0x04, termios.VTIME: 0, termios.VMIN: 1, termios.VSTART: 0x11,
    termios.VSTOP: 0x13, termios.VSUSP: 0x1A, termios.VEOL: 0, termios.VREPRINT: 0x12,
    termios.VDISCARD: 0x0F, termios.VWERASE: 0x17, termios.VLNEXT: 0x16, termios.VEOL2: 0,
}


def tool_modes(attributes: list) -> list:
    """The termios the framing needs, from a tty's current ones: canonical input, no echo,
    signals on, no flow control, output bytes unchanged ("\\n" stays "\\n")."""
    iflag, oflag, cflag, lflag, ispeed, ospeed, cc = attributes
    iflag = (iflag | termios.ICRNL) & ~(termios.IXON | termios.IXOFF | termios.INLCR | termios.IGNCR | termios.ISTRIP)
    oflag = (oflag | termios.OPOST) & ~(termios.ONLCR | termios.OCRNL | termios.ONOCR | termios.ONLRET)
    cflag = (cflag | termios.CS8 | termios.CREAD) & ~termios.PARENB
    lflag = (lflag | termios.ICANON | termios.ISIG | termios.IEXTEN) & ~(
        termios.ECHO | termios.ECHONL | termios.ECHOE | termios.ECHOK | termios.TOSTOP | termios.NOFLSH
    )
    cc = list(cc)
    for index, value in _DEFAULT_CC.items():
        cc[index] = value if isinstance(cc[index], int) else bytes([value])
    return [iflag, oflag, cflag, lflag, ispeed, ospeed, cc]


def interactive_bash(cmdline: bytes) -> bool:
    """Whether a process's /proc cmdline is an interactive bash: no `-c`, and no script
    argument unless `-i` or `-s` (bash's own rule, given that its stdin is a terminal)."""
    argv = cmdline.split(b"\0")
    if os.path.basename(argv[0]).lstrip(b"-") != b"bash":
        return False
    forced = False
    index = 1
    while index < len(argv) and argv[index]:
        word = argv[index]
        if word == b"--":
            return forced or index + 1 >= len(argv) or not argv[index + 1]
        if word in _BASH_OPTIONS_WITH_ARGUMENT:
            index += 2
            continue
        if word[:1] in (b"-", b"+") and len(word) > 1 and not word.startswith(b"--"):
            if word[:1] == b"-" and b"c" in word:
                return False
            forced = forced or b"i" in word or b"s" in word
        elif not word.startswith(b"--"):
            return forced  # a script file
        index += 1
    return True


class Terminal:
    """The master side of the shell's pty; `modes` None where the pty is someone else's
    (docker exec -t), whose shell restores its modes itself."""

    def __init__(self, fd: int, modes: list | None) -> None:
        self.fd = fd
        self.modes = modes
        self.modes_bytes = b""

    def close(self) -> None:
        """The master belongs to the shell's pty process: nothing of its own to close."""

    def _foreground_group(self) -> int:
        return os.tcgetpgrp(self.fd)

    def restore(self) -> bool:
        """Put back the tool's termios and window size if a command changed them (stty,
        a program killed in raw mode), dropping input typed into a changed terminal.
        Returns whether the tty was turning newlines into CRLF (`stty sane`, onlcr)."""
        if self.modes is None:
            return False
        crlf = False
        try:
            if fcntl.ioctl(self.fd, termios.TCGETS, _TERMIOS_BUFFER) != self.modes_bytes:
                current = termios.tcgetattr(self.fd)
                if current != self.modes:
                    crlf = bool(current[1] & termios.OPOST and current[1] & termios.ONLCR)
                    termios.tcflush(self.fd, termios.TCIFLUSH)
                    termios.tcsetattr(self.fd, termios.TCSANOW, self.modes)
                self.modes_bytes = fcntl.ioctl(self.fd, termios.TCGETS, _TERMIOS_BUFFER)
            if fcntl.ioctl(self.fd, termios.TIOCGWINSZ, _WINSIZE) != _WINSIZE:
                fcntl.ioctl(self.fd, termios.TIOCSWINSZ, _WINSIZE)
        except (termios.error, OSError):
            pass
        return crlf

    def foreground(self) -> tuple[int, bytes] | None:
        """The pty's foreground process group and its leader's command line."""
        try:
            group = self._foreground_group()
            with open(f"/proc/{group}/cmdline", "rb") as handle:
                return group, handle.read()
        except OSError:
            return None

    def bash_inside(self, shell: tuple[int, bytes] | None) -> bool:
        """Whether the foreground job is an interactive bash the agent started in `shell`
        (`bash`), left waiting at its prompt: it has no setup and prints no marker until it
        exits."""
        now = self.foreground()
        if shell is None or now is None or now[0] == shell[0] or not interactive_bash(now[1]):
            return False
        try:  # reading the terminal (not `bash < file`)
            return os.stat(f"/proc/{now[0]}/fd/0").st_rdev == os.stat(f"/proc/{shell[0]}/fd/0").st_rdev
        except OSError:
            return True

    def replaced_by_bash(self, shell: tuple[int, bytes] | None) -> bool:
        """Whether `shell`, in the foreground again, now runs another command line, a
        bash's: `exec bash` (a terminal's way to start afresh) left a shell without our setup."""
        now = self.foreground()
        if shell is None or now is None or now[0] != shell[0] or now[1] == shell[1]:
            return False
        return os.path.basename(now[1].split(b"\0", 1)[0]) == b"bash"

    def signal_foreground(self, signum: int) -> bool:
        """Signal the pty's foreground process group, as the tty does for Ctrl-C when its
        ISIG is on; works whatever the agent set. False where there is none to signal."""
        try:
            group = self._foreground_group()
            if group <= 0:
                return False
            os.killpg(group, signum)
            return True
        except OSError:
            return False


class ContainerTerminal(Terminal):
    """The terminal of a shell that `docker exec -t` runs in a container, reached from the
    host: the slave side of the container's pty (the shell's fd 255, opened through /proc),
    whose modes and window size the supervisor then puts back as for a pty of its own, with no
    `stty` process in the container per command. The foreground job is read from /proc
    (TIOCGPGRP answers only a session's own terminal); /proc gives host pids, signalled from
    here, as root: so the shell is held by a pidfd (its pid, once it exited, may be a host
    process's, whose terminal is a host user's), and the group signalled must be led by a
    process of the container's pid namespace, alive while it is checked (`_checked_group`)."""

    def __init__(self, fd: int, modes: list, shell_pid: int, pid_namespace: str, shell_pidfd: int) -> None:
        super().__init__(fd, modes)
        self.shell_pid = shell_pid
        self.pid_namespace = pid_namespace
        self.shell_pidfd = shell_pidfd

    def close(self) -> None:
        for fd in (self.fd, self.shell_pidfd):
            try:
                os.close(fd)
            except OSError:
                pass

    def _foreground_group(self) -> int:
        with open(f"/proc/{self.shell_pid}/stat", "rb") as handle:
            stat = handle.read()
        # Read while the shell was alive, so from the shell: its pid cannot have been reused.
        if not _alive(self.shell_pidfd):
            raise ProcessLookupError(f"the container's shell {self.shell_pid} has exited")
        return int(stat[stat.rindex(b")") + 2 :].split()[5])  # tpgid

    def signal_foreground(self, signum: int) -> bool:
        try:
            group = self._foreground_group()
            return group > 0 and _signal_group_inside(group, self.pid_namespace, signum)
        except OSError:
            return False


def _alive(pidfd: int) -> bool:
    """Whether the process a pidfd holds has not exited (a pidfd polls readable once it has)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


def _signal_group_inside(group: int, pid_namespace: str, signum: int) -> bool:
    """killpg(group) only if its leader is a process of `pid_namespace` that leads `group`,
    still alive after the check (held by a pidfd): while it lives, no other group takes its
    number. A group whose leader has exited is not signalled (False: the caller falls back)."""
    leader = os.pidfd_open(group)
    try:
        if os.readlink(f"/proc/{group}/ns/pid") != pid_namespace:
            return False
        with open(f"/proc/{group}/stat", "rb") as handle:
            stat = handle.read()
        if int(stat[stat.rindex(b")") + 2 :].split()[2]) != group or not _alive(leader):  # pgrp
            return False
        os.killpg(group, signum)
        return True
    finally:
        os.close(leader)


def container_pid_namespace(inspect_argv: list[str], env: dict[str, str]) -> str | None:
    """The pid namespace of a container (e.g. "pid:[4026532252]"), from its engine:
    `inspect_argv` prints the host pid of the container's first process and the container's
    id. Trusted only where this process sees that pid as the first of its namespace, in a
    cgroup named by the id: the engine runs on this host, in this view of its pids (not a
    remote engine, nor one whose pids are another namespace's). None otherwise."""
    try:
        done = subprocess.run(inspect_argv, capture_output=True, text=True, timeout=30, env=env)
        pid_text, container_id = done.stdout.split()
        pid = int(pid_text)
        if pid <= 0 or not re.fullmatch(r"[0-9a-f]{64}", container_id):
            return None
        with open(f"/proc/{pid}/cgroup") as handle:
            if container_id not in handle.read():
                return None
        if _innermost_pid(pid) != 1:
            return None
        return os.readlink(f"/proc/{pid}/ns/pid")
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def reach_container_terminal(inside_pid: int, pid_namespace: str) -> ContainerTerminal | None:
    """The terminal of the shell whose pid is `inside_pid` in the pid namespace
    `pid_namespace` (container_pid_namespace), when this process can reach it (on the
    container's host, with the rights to open another process's descriptors); None
    otherwise, and the shell restores its modes itself."""
    if not re.fullmatch(r"pid:\[\d+\]", pid_namespace):
        return None
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            # The namespace first: one readlink rules out the host's other processes.
            if os.readlink(f"/proc/{entry}/ns/pid") != pid_namespace:
                continue
            found = _terminal_of(int(entry), inside_pid, pid_namespace)
            if found is not None:
                return found
        except OSError:
            continue
    return None


def _terminal_of(pid: int, inside_pid: int, pid_namespace: str) -> ContainerTerminal | None:
    """The terminal of host process `pid` if it is the shell `inside_pid` of `pid_namespace`:
    held by a pidfd opened before the checks and alive after them, so that they were of it."""
    pidfd = os.pidfd_open(pid)
    try:
        if _innermost_pid(pid) != inside_pid or os.readlink(f"/proc/{pid}/ns/pid") != pid_namespace:
            return None
        for number in (255, 0):
            fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            try:
                if os.isatty(fd) and _alive(pidfd):
                    terminal = ContainerTerminal(fd, tool_modes(termios.tcgetattr(fd)), pid, pid_namespace, pidfd)
                    fd = pidfd = -1  # the terminal's now
                    return terminal
            except termios.error:
                pass
            finally:
                if fd >= 0:
                    os.close(fd)
        return None
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _innermost_pid(pid: int) -> int | None:
    """Process `pid`'s pid in its own (innermost) pid namespace: the last of its NSpid."""
    with open(f"/proc/{pid}/status", "rb") as handle:
        found = re.search(rb"^NSpid:[\t ]*([\d\t ]+)$", handle.read(), re.M)
    return int(found.group(1).split()[-1]) if found else None


def signal_from_beside(spawn: Callable[[], ptyprocess.PtyProcess], pid: int, signum: int, timeout_s: float) -> bool:
    """Signal the foreground job of process `pid`'s terminal from a second shell that `spawn`
    starts the way the first was (`docker exec -t`, whose pty inside the container the
    supervisor cannot reach): a typed Ctrl-C is input where the agent turned ISIG off (raw
    mode). Costs one more `docker exec` (a few hundred ms), only on a timeout."""
    # Field 8 of /proc/PID/stat: the foreground process group of PID's terminal.
    line = f"read -r _ _ _ _ _ _ _ g _ </proc/{pid}/stat && kill -{signum} -- -$g; exit\n".encode()
    try:
        helper = spawn()
    except (OSError, ptyprocess.PtyProcessError):
        return False
    try:
        os.write(helper.fd, line)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and select.select([helper.fd], [], [], deadline - time.monotonic())[0]:
            try:
                if not os.read(helper.fd, 1 << 16):
                    break
            except OSError:  # EIO: the helper exited
                break
    finally:
        helper.delayafterclose = helper.delayafterterminate = 0
        try:
            helper.close(force=True)
        except (OSError, ptyprocess.PtyProcessError):
            pass
    return True
