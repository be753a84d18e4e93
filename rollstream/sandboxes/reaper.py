"""The node's reaper: ends sandboxes nobody wants and cleans up after crashed supervisors.

A sandbox is reaped when its owner is no longer wanted (job finished, failed, cancelled),
or when its supervisor is gone but its folder, processes or container remain. Also holds
the forced teardown that destroy_sandbox falls back to. It acts only on what it wrote: in a
sandbox root that passes roots.check_root, a folder, plan.json and confinement.json of our
uid that no one else may write; anything else is left alone and logged.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from .roots import UnsafeSandboxRoot, check_root, default_root_dir, written_by_us
from .runtime.confine import Confinement, ForeignRecord, sweep_orphans
from .runtime.plan import Plan
from .runtime.supervisor import remove_tree

log = logging.getLogger(__name__)

_children: dict[int, subprocess.Popen] = {}
_PR_SET_CHILD_SUBREAPER = 36


def register_child(process: subprocess.Popen) -> None:
    """Remember a supervisor this process started, so that its exit status gets collected."""
    _children[process.pid] = process


def reap_finished_children() -> None:
    """Collect exited supervisors started by this process (no zombies in long-lived workers)."""
    for pid, process in list(_children.items()):
        if process.poll() is not None:
            _children.pop(pid, None)


def become_subreaper() -> None:
    """Adopt orphans of this process's descendants (Linux), so `Reaper.reap` can collect them.

    Useful for a node agent whose pid 1 does not reap zombies (some container inits).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _collect(pid: int) -> None:
    process = _children.pop(pid, None)
    if process is not None:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _plan(directory: str) -> Plan:
    """The sandbox's plan, if this uid wrote it (a plan names commands the reaper runs)."""
    path = os.path.join(directory, "plan.json")
    if not written_by_us(path):
        if os.path.lexists(path):
            log.warning("ignoring %s: not a file of uid %d that only it may write", path, os.geteuid())
        return {}
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def ours_to_tear_down(directory: str) -> str:
    """Why the sandbox folder `directory` is not ours to act upon, or "" when it is: a folder of
    our uid that no one else may write, in a sandbox root that passes check_root."""
    try:
        check_root(os.path.dirname(os.path.abspath(directory)))
    except UnsafeSandboxRoot as error:
        return str(error)
    if not written_by_us(directory, folder=True):
        return f"{directory} is not a folder of uid {os.geteuid()} that only it may write"
    return ""


def _pid_from_file(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, "supervisor.pid")) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie child of ours is collected and counts as gone."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    _collect(pid)
    return False


SUPERVISOR_NAME = "rs-supervisor"  # the process name the fork server gives each supervisor


def live_supervisors(root_dir: str | os.PathLike) -> list[psutil.Process]:
    """Live (not zombie) sandbox supervisors whose sandbox folder is under ``root_dir``."""
    root = os.fspath(root_dir)
    found = []
    for proc in psutil.process_iter(["name", "cwd", "status"]):
        try:
            if proc.info["name"] == SUPERVISOR_NAME and proc.info["status"] != psutil.STATUS_ZOMBIE \
                    and (proc.info.get("cwd") or "").startswith(root):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def supervisor_running(directory: str, pid: int | None) -> bool:
    """True when `pid` is alive and is the supervisor of `directory` (not a reused pid)."""
    if pid is None:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        # A forked supervisor runs in its folder; one started directly also names its plan.
        return process.cwd() == directory or os.path.join(directory, "plan.json") in process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                _collect(pid)
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.01)
    return False


def leftover_processes(directory: str) -> list[psutil.Process]:
    """Processes that belong to a sandbox folder: its path in their command line or cwd."""
    found = []
    marker = directory.rstrip("/") + "/"
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if process.pid == os.getpid() or process.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(process.info["cmdline"] or [])
            cwd = process.info["cwd"] or ""
            if marker in cmdline or cwd == directory or cwd.startswith(marker):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def teardown(directory: str, pid: int | None = None, term_grace_s: float = 5.0) -> None:
    """Stop a sandbox by force if needed: supervisor, processes, container, folder.

    A folder that is not ours (ours_to_tear_down) is left as it is, with a warning: its plan
    and confinement record could name any command, cgroup or mount point."""
    refused = ours_to_tear_down(directory) if os.path.lexists(directory) else ""
    if refused:
        log.warning("not tearing down %s: %s", directory, refused)
        return
    pid = pid or _pid_from_file(directory)
    if supervisor_running(directory, pid):
        assert pid is not None
        os.kill(pid, signal.SIGTERM)  # the supervisor tears its sandbox down on SIGTERM
        if not _wait_gone(pid, term_grace_s):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, term_grace_s)
    if pid is not None:
        _collect(pid)
    if not os.path.isdir(directory):
        return  # the supervisor cleaned up after itself
    plan = _plan(directory)
    try:
        confinement = Confinement.load(directory)
    except ForeignRecord as error:
        log.warning("sandbox %s: not releasing its cgroups and mount: %s", directory, error)
        confinement = None
    if confinement is not None:
        # The cgroup holds every process of the sandbox, double-forked ones included; the
        # tmpfs must be unmounted before the folder can go.
        stuck = confinement.release()
        if stuck:
            log.warning("sandbox %s: could not release %s", plan.get("sandbox_id"), "; ".join(stuck))
    for process in leftover_processes(directory):
        try:
            process.kill()
            process.wait(timeout=5)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired):
            pass
        _collect(process.pid)
    if cleanup_argv := plan.get("cleanup_argv"):
        try:
            subprocess.run(cleanup_argv, capture_output=True, timeout=60, env=plan.get("host_env"))
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("cleanup of sandbox %s failed: %s", plan.get("sandbox_id"), error)
    remove_tree(directory)


@dataclass
class SandboxRecord:
    id: str
    owner: str
    backend: str
    dir: str
    supervisor_pid: int | None
    running: bool
    created_at: float


def _replaced_since(record: SandboxRecord) -> bool:
    """Whether the folder now holds another sandbox than the one listed in ``record`` (made
    later under the same id): its plan's creation time or its supervisor differ."""
    if not os.path.isdir(record.dir):
        return False
    created = _plan(record.dir).get("created_at")
    if created and created != record.created_at:  # the listing fell back to the folder's time without one
        return True
    pid = _pid_from_file(record.dir)
    return pid is not None and record.supervisor_pid is not None and pid != record.supervisor_pid


class Reaper:
    """`Reaper(root_dir).reap(is_wanted)` ends every sandbox of this node that is not wanted."""

    def __init__(self, root_dir: str | None = None, stale_after_s: float = 120.0) -> None:
        self.root_dir = os.path.abspath(root_dir or default_root_dir())
        self.stale_after_s = stale_after_s

    def sandboxes(self) -> list[SandboxRecord]:
        """The sandboxes of the root; raises UnsafeSandboxRoot for a root others could change."""
        records = []
        if not os.path.lexists(self.root_dir):
            return []
        check_root(self.root_dir)
        try:
            names = sorted(os.listdir(self.root_dir))
        except FileNotFoundError:
            return []
        for name in names:
            if name.startswith("."):
                continue  # the fork server's files; sandbox ids never start with a dot
            directory = os.path.join(self.root_dir, name)
            if not os.path.isdir(directory):
                continue
            if not written_by_us(directory, folder=True):
                log.warning("ignoring %s: not a sandbox folder of uid %d that only it may write", directory,
                            os.geteuid())
                continue
            plan = _plan(directory)
            pid = _pid_from_file(directory)
            try:
                created = plan.get("created_at") or os.stat(directory).st_mtime
            except FileNotFoundError:
                continue
            records.append(
                SandboxRecord(
                    id=plan.get("sandbox_id", name),
                    owner=plan.get("owner", ""),
                    backend=plan.get("backend", ""),
                    dir=directory,
                    supervisor_pid=pid,
                    running=supervisor_running(directory, pid),
                    created_at=created,
                )
            )
        return records

    def reap_one(self, record: SandboxRecord, is_wanted: Callable[[str, str], bool]) -> bool:
        """Tear down the sandbox ``record`` describes if no job wants it; True when torn down."""
        if not record.running and record.supervisor_pid is None:
            # Being created right now, or a creation that crashed long ago.
            if time.time() - record.created_at < self.stale_after_s:
                return False
        elif record.running:
            try:
                if is_wanted(record.id, record.owner):
                    return False
            except Exception:
                log.exception("is_wanted failed for sandbox %s; keeping it", record.id)
                return False
        if _replaced_since(record):
            # A new sandbox took the name since the listing (eval's fresh sandbox for verification
            # reuses the job's id): what was listed is gone already, and the new one is not ours to judge.
            log.info("not reaping sandbox %s: replaced by a new one since it was listed", record.id)
            return False
        log.info("reaping sandbox %s (owner %s, supervisor running: %s)", record.id, record.owner, record.running)
        teardown(record.dir, record.supervisor_pid)
        return True

    def reap(self, is_wanted: Callable[[str, str], bool]) -> list[str]:
        """Tear down unwanted sandboxes and leftovers of dead ones; returns the reaped ids.
        Raises UnsafeSandboxRoot, touching nothing, for a root other users could change."""
        reap_finished_children()
        reaped = [record.id for record in self.sandboxes() if self.reap_one(record, is_wanted)]
        # Cgroups and mounts of sandboxes whose folder was deleted (rm -rf of a sandbox root).
        for leftover in sweep_orphans():
            log.info("released the orphaned sandbox cgroup or mount %s", leftover)
        return reaped
