"""Issue 32, finding 9: behind `docker exec -t` the supervisor (root) reaches the container
shell's terminal from the host and signals its foreground job by host pid, read from
/proc/<shell pid>/stat. Once that shell exited, its pid could be a host process's: root then
read the foreground job of a host user's terminal and killed it. The shell is now held by a
pidfd, and a group is signalled only if its leader is a live process of the container's pid
namespace.

The container here is a real one as the kernel sees it: a bash on a pty in a pid namespace of
its own (bubblewrap); the pid is reused for real, by a host bash on a terminal of its own
(/proc/sys/kernel/ns_last_pid picks the next pid)."""

from __future__ import annotations

import os
import shutil
import signal
import time

import psutil
import ptyprocess
import pytest

from rollstream.sandboxes.runtime.bash_terminal import reach_container_terminal

pytestmark = pytest.mark.skipif(not shutil.which("bwrap") or os.geteuid() != 0,
                                reason="needs bwrap, and root to choose the next pid")
NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
WAIT_S = 10.0


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _tpgid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        stat = handle.read()
    return int(stat[stat.rindex(b")") + 2 :].split()[5])


def _container_shell(container: ptyprocess.PtyProcess) -> psutil.Process:
    def found() -> psutil.Process | None:
        own = os.readlink("/proc/self/ns/pid")
        for child in psutil.Process(container.pid).children(recursive=True):
            if child.name() == "bash" and os.readlink(f"/proc/{child.pid}/ns/pid") != own:
                return child
        return None

    _wait(lambda: found() is not None, "the container's shell")
    shell = found()
    assert shell is not None
    return shell


def _host_shell_with_pid(pid: int) -> ptyprocess.PtyProcess:
    """A host bash on a terminal of its own that gets host pid `pid` (now free)."""
    for _ in range(200):
        with open(NS_LAST_PID, "w") as handle:
            handle.write(str(pid - 1))
        shell = ptyprocess.PtyProcess.spawn(["bash", "--norc", "--noprofile", "-i"], env={"PATH": "/usr/bin:/bin"})
        if shell.pid == pid:
            return shell
        shell.terminate(force=True)  # another process of the node took it first: again
    raise AssertionError(f"could not start a host shell with pid {pid}")


def _inside(shell: psutil.Process) -> int:
    with open(f"/proc/{shell.pid}/status") as handle:
        return int(next(line for line in handle if line.startswith("NSpid:")).split()[-1])


def test_a_reused_host_pid_never_makes_root_signal_a_host_terminals_foreground_job():
    container = ptyprocess.PtyProcess.spawn(
        ["bwrap", "--unshare-pid", "--dev-bind", "/", "/", "--proc", "/proc", "--die-with-parent", "--",
         "bash", "--norc", "--noprofile", "-i"], env={"PATH": "/usr/bin:/bin"})
    victim = None
    try:
        shell = _container_shell(container)
        namespace = os.readlink(f"/proc/{shell.pid}/ns/pid")
        terminal = reach_container_terminal(_inside(shell), namespace)
        assert terminal is not None, "the container shell's terminal was not reached from the host"
        # While the shell lives, its foreground job is signalled as before.
        container.write(b"sleep 600\n")
        _wait(lambda: _tpgid(shell.pid) != shell.pid, "sleep in the container's foreground")
        job = _tpgid(shell.pid)
        assert terminal.signal_foreground(signal.SIGKILL)
        _wait(lambda: not psutil.pid_exists(job), "the container's job to die")

        # The container goes; a host user's shell gets its shell's pid, with a job in front.
        old_pid = shell.pid
        container.terminate(force=True)
        _wait(lambda: not psutil.pid_exists(old_pid), "the container's shell pid to be free")
        victim = _host_shell_with_pid(old_pid)
        victim.write(b"sleep 600\n")
        _wait(lambda: _tpgid(old_pid) not in (old_pid, -1), "sleep in the host terminal's foreground")
        host_job = _tpgid(old_pid)

        signalled = terminal.signal_foreground(signal.SIGKILL)
        time.sleep(0.1)  # a SIGKILL sent is delivered at once; this only lets the zombie show
        assert psutil.pid_exists(host_job) and psutil.Process(host_job).status() != psutil.STATUS_ZOMBIE, \
            "root killed the foreground job of a host terminal"
        assert not signalled
        assert terminal.foreground() is None
        terminal.close()
    finally:
        for process in (container, victim):
            if process is not None and process.isalive():
                process.terminate(force=True)
