"""Kernel-enforced limits of one sandbox: a cgroup (processes, memory, CPU) and a sized tmpfs (disk).

The supervisor creates them at start (`Confinement.create`), every process it spawns joins
the cgroup before it execs (`join_files`, bash_session.join_cgroups), and `release` kills all that is left in the
cgroup, unmounts the tmpfs and removes the cgroup; the node's reaper calls `release` too
(through the record in the sandbox folder) when a supervisor crashed. Where cgroups or
mounts are not ours to use (not root, read-only cgroupfs), the rlimits in the plan apply
alone and `describe` says so. Stdlib only: it runs in the supervisor.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import signal
import time
from stat import S_ISREG, S_IWGRP, S_IWOTH
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan
if __package__:
    from .env_settings import env_setting
else:  # python -S supervisor.py: sibling modules are top-level
    from env_settings import env_setting

RECORD_NAME = "confinement.json"
# Parent folder of every sandbox cgroup, inside this process's own cgroup (so sandboxes
# stay within a Slurm job's or a container's limits), or under $ROLLSTREAM_CGROUP_ROOT
# (cgroup v2: a delegated folder without processes of its own, e.g. systemd Delegate=yes).
CGROUP_DIR_NAME = "rollstream"
_CONTROLLERS = ("pids", "memory", "cpu")
_CPU_PERIOD_US = 100_000
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2
# The tmpfs's source name in /proc/self/mountinfo: how the reaper tells our mounts apart.
MOUNT_SOURCE = b"rollstream-sandbox"


class ForeignRecord(RuntimeError):
    """A confinement.json this uid did not write, or one naming cgroups or a mount that are
    not its sandbox's: acting on it would kill or unmount what someone else chose."""


class Hierarchy:
    """One cgroup hierarchy we may use: v2 (all controllers) or a v1 one (one controller each)."""

    def __init__(self, version: int, base: str, controllers: list[str]) -> None:
        self.version = version
        self.base = base
        self.controllers = controllers


def _mountinfo() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of the cgroup mounts of this process."""
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_cgroups() -> dict[str, str]:
    """Controller (or '' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    return paths


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _under(mount_root: str, mount_point: str, path: str) -> str:
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else path.lstrip("/")
    return os.path.normpath(os.path.join(mount_point, "" if relative == "." else relative))


def _v2_base(mount_root: str, mount_point: str, own: str, wanted: list[str]) -> tuple[Hierarchy | None, str]:
    base = env_setting("CGROUP_ROOT")
    if base:
        parent = os.path.dirname(base)
    else:
        parent = _under(mount_root, mount_point, own)
        base = os.path.join(parent, CGROUP_DIR_NAME)
    with open(os.path.join(parent, "cgroup.controllers")) as handle:
        available = [name for name in wanted if name in handle.read().split()]
    if not available:
        return None, f"cgroup v2 at {parent} offers none of {', '.join(wanted)}"
    refused = ""
    try:
        # Refused (EBUSY) when the parent holds processes itself, unless it is the root.
        _write(os.path.join(parent, "cgroup.subtree_control"), " ".join(f"+{n}" for n in available))
    except OSError as error:
        refused = error.strerror or str(error)
    try:
        os.makedirs(base, exist_ok=True)
        with open(os.path.join(base, "cgroup.controllers")) as handle:
            delegated = handle.read().split()
        available = [name for name in available if name in delegated]
        if available:
            _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{n}" for n in available))
    except OSError as error:
        refused, available = error.strerror or str(error), []
    if not available:
        return None, (
            f"cgroup v2 at {parent} cannot be delegated ({refused or 'no controllers'}); run as root in "
            "the root cgroup, or set ROLLSTREAM_CGROUP_ROOT to a delegated cgroup folder"
        )
    return Hierarchy(2, base, available), ""


def discover() -> tuple[list[Hierarchy], str]:
    """The hierarchies this process may create sandbox cgroups in, and why not where none."""
    try:
        mounts, own = _mountinfo(), _own_cgroups()
    except OSError as error:
        return [], f"cgroups unreadable: {error}"
    hierarchies: list[Hierarchy] = []
    reasons: list[str] = []
    left = list(_CONTROLLERS)
    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            try:
                hierarchy, reason = _v2_base(root, point, own[""], left)
            except OSError as error:
                hierarchy, reason = None, f"cgroup v2 at {point}: {error}"
            if hierarchy is not None:
                hierarchies.append(hierarchy)
                left = [name for name in left if name not in hierarchy.controllers]
            elif reason:
                reasons.append(reason)
    for root, point, fstype, options in mounts:
        names = [name for name in left if name in options]
        if fstype != "cgroup" or not names or names[0] not in own:
            continue
        base = os.path.join(_under(root, point, own[names[0]]), CGROUP_DIR_NAME)
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as error:
            reasons.append(f"cgroup v1 {','.join(names)} at {point}: {error.strerror}")
            continue
        hierarchies.append(Hierarchy(1, base, names))
        left = [name for name in left if name not in names]
    if not left:
        reasons = []  # all found; a v2 mount without controllers beside v1 ones is no news
    elif not hierarchies and not reasons:
        reasons.append("no cgroup hierarchy with pids, memory or cpu is mounted")
    return hierarchies, "; ".join(reasons)


_discovered: tuple[list[Hierarchy], str] | None = None


def hierarchies() -> tuple[list[Hierarchy], str]:
    """`discover()`, once per process (the fork server's answer is inherited by supervisors)."""
    global _discovered
    if _discovered is None:
        _discovered = discover() if os.geteuid() == 0 or env_setting("CGROUP_ROOT") else (
            [], "not root: cgroups and mounts are not ours to create (set ROLLSTREAM_CGROUP_ROOT "
            "to a delegated cgroup v2 folder)"
        )
    return _discovered


class Confinement:
    """The cgroups and tmpfs of one sandbox, as recorded in its folder's confinement.json."""

    def __init__(self, record: dict) -> None:
        self.record = record
        # The pids cgroup's counters are read around every bash call: with one pread on a
        # descriptor kept open (opening them costs each call ~50 µs).
        self._descriptors: dict[str, int] = {}

    # -- creation (supervisor) ---------------------------------------------------------
    @classmethod
    def create(cls, plan: Plan) -> Confinement:
        """Make the sandbox's cgroup and tmpfs where possible; never raises for a missing one."""
        record: dict = {"cgroups": [], "versions": [], "tmpfs": None, "limits": {}, "fallback": ""}
        confinement = cls(record)
        path = os.path.join(plan["dir"], RECORD_NAME)
        found, reason = hierarchies() if plan.get("confine_processes", True) else ([], "the container runtime")
        off = env_setting("SANDBOX_CONFINE") == "off"  # another layer enforces limits
        if off:
            found, reason = [], "turned off by ROLLSTREAM_SANDBOX_CONFINE=off"
        wanted = {"pids": True, "memory": bool(plan.get("memory_bytes")), "cpu": bool(plan.get("cpus"))}
        # Each hierarchy joined costs a migration per spawned shell: only those with a limit.
        found = [h for h in found if any(wanted.get(name) for name in h.controllers)]
        name = f"{plan['sandbox_id']}.{os.getpid()}"
        record["cgroups"] = [os.path.join(h.base, name) for h in found]
        record["versions"] = [h.version for h in found]
        data_dir, disk_bytes = plan.get("data_dir"), plan.get("disk_bytes")
        if data_dir and disk_bytes and os.geteuid() == 0 and not off:
            record["tmpfs"] = data_dir
        # Recorded before anything is made: a crash from here on leaves the reaper a list.
        confinement.save(path)
        try:
            confinement._make_cgroups(found, plan)
        except OSError as error:
            confinement.kill_and_remove_cgroups()
            record["cgroups"], record["versions"] = [], []
            reason = f"creating the cgroup failed: {error}"
        record["fallback"] = reason
        if record["tmpfs"] and data_dir and disk_bytes:
            try:
                confinement._mount_tmpfs(data_dir, disk_bytes)
            except OSError as error:
                record["tmpfs"] = None
                record["fallback"] += f"; tmpfs on {data_dir} failed: {error}"
        confinement.save(path)
        return confinement

    def _make_cgroups(self, found: list[Hierarchy], plan: Plan) -> None:
        limits = self.record["limits"]
        for hierarchy, path in zip(found, self.record["cgroups"]):
            os.mkdir(path)
            v2 = hierarchy.version == 2
            for controller in hierarchy.controllers:
                if controller == "pids":
                    value = plan.get("max_processes")
                    _write(os.path.join(path, "pids.max"), str(value) if value else "max")
                    limits["pids"] = value
                elif controller == "memory" and plan.get("memory_bytes"):
                    value = plan["memory_bytes"]
                    _write(os.path.join(path, "memory.max" if v2 else "memory.limit_in_bytes"), str(value))
                    if not v2:  # RAM + swap: swap is no way around the limit
                        try:
                            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(value))
                        except OSError:
                            pass  # swap accounting off in this kernel
                    limits["memory_bytes"] = value
                elif controller == "cpu" and (cpus := plan.get("cpus")):
                    quota = max(1000, int(cpus * _CPU_PERIOD_US))
                    if v2:
                        _write(os.path.join(path, "cpu.max"), f"{quota} {_CPU_PERIOD_US}")
                    else:
                        _write(os.path.join(path, "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
                        _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
                    limits["cpus"] = cpus

    def _mount_tmpfs(self, data_dir: str, disk_bytes: int) -> None:
        # tmpfs counts each file's pages towards the memory cgroup of its writer, so the
        # sandbox's files share its memory limit; inodes are capped too (empty files are free).
        inodes = max(16384, disk_bytes // 8192)
        options = f"size={disk_bytes},nr_inodes={inodes},mode=0700".encode()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(MOUNT_SOURCE, data_dir.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        for name in ("work", "tmp"):
            os.mkdir(os.path.join(data_dir, name))
        os.chmod(os.path.join(data_dir, "tmp"), 0o1777)  # like a real /tmp, for any sandbox uid

    def save(self, path: str) -> None:
        # Never writable by others, whatever the umask: the reaper trusts no other record (load).
        fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w") as handle:
            json.dump(self.record, handle)
        os.replace(path + ".new", path)

    @classmethod
    def load(cls, directory: str) -> Confinement | None:
        """The record of the sandbox folder `directory`; None without one. Raises ForeignRecord
        for a record not written by this uid, or one whose cgroups and mount are not those of
        this sandbox (named ID.PID in a `rollstream` cgroup folder, `<directory>/data`)."""
        path = os.path.join(directory, RECORD_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as error:  # ELOOP: a symlink
            raise ForeignRecord(f"{path} cannot be opened as a file of ours: {error.strerror}") from None
        with os.fdopen(fd) as handle:
            info = os.fstat(fd)
            if not S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & (S_IWGRP | S_IWOTH):
                raise ForeignRecord(f"{path} is not a file of uid {os.geteuid()} that only it may write")
            try:
                record = json.load(handle)
            except ValueError:
                return None  # cut short by a crash while it was first written
        if not isinstance(record, dict):
            return None
        record.setdefault("cgroups", [])
        record.setdefault("versions", [])
        record.setdefault("limits", {})
        record.setdefault("tmpfs", None)
        problems = _foreign_parts(record, os.path.abspath(directory))
        if problems:
            raise ForeignRecord(f"{path} names {'; '.join(problems)}")
        return cls(record)

    # -- while running -----------------------------------------------------------------
    @property
    def join_files(self) -> list[str]:
        """The cgroup.procs files each sandbox process writes '0' to before it execs."""
        return [os.path.join(path, "cgroup.procs") for path in self.record["cgroups"]]

    @property
    def disk_on_tmpfs(self) -> bool:
        return bool(self.record["tmpfs"])

    def _pids_path(self) -> str | None:
        for path in self.record["cgroups"]:
            if os.path.exists(os.path.join(path, "pids.max")):
                return path
        return None

    def _read_pids_file(self, name: str) -> bytes | None:
        """The content of the pids cgroup's file `name`; None without one (or once removed)."""
        try:
            fd = self._descriptors.get(name)
            if fd is None:
                path = self._pids_path()
                if path is None:
                    return None
                fd = self._descriptors[name] = os.open(os.path.join(path, name), os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 4096, 0)
        except OSError:
            return None

    def close_counters(self) -> None:
        descriptors, self._descriptors = self._descriptors, {}
        for fd in descriptors.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def pid_limit_hits(self) -> int:
        """How often a fork failed at the process limit so far (pids.events 'max')."""
        events = self._read_pids_file("pids.events")
        for line in (events or b"").splitlines():
            key, _, value = line.partition(b" ")
            if key == b"max" and value.strip().isdigit():
                return int(value)
        return 0

    def at_process_limit(self) -> bool:
        """True while the sandbox holds as many processes as pids.max allows (or one less)."""
        limit = (self._read_pids_file("pids.max") or b"").strip()
        if not limit.isdigit():
            return False  # "max", or no pids cgroup
        current = (self._read_pids_file("pids.current") or b"").strip()
        return current.isdigit() and int(current) >= int(limit) - 1

    def wait_below_process_limit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.at_process_limit():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def disk_full_note(self) -> str:
        if not self.record["tmpfs"]:
            return ""
        try:
            stat = os.statvfs(self.record["tmpfs"])
        except OSError:
            return ""
        if stat.f_bavail > 0 and stat.f_favail > 0:
            return ""
        size_mib = stat.f_blocks * stat.f_frsize // 2**20
        return f"the sandbox's disk ({size_mib} MiB for the workdir and /tmp) is full; delete files to write more"

    def describe(self, plan: Plan) -> dict[str, str]:
        """Which mechanism holds each limit, for info and status."""
        versions = {p: v for p, v in zip(self.record["cgroups"], self.record["versions"])}
        limits = self.record["limits"]
        rlimits = plan.get("rlimits", {})

        def cgroup(key: str, text: str) -> str | None:
            if key not in limits:
                return None
            owner = next((p for p in self.record["cgroups"] if _has_file(p, key)), "")
            return f"cgroup v{versions.get(owner, '?')} {text} ({owner})"

        # Root ignores RLIMIT_NPROC, but a root supervisor's bwrap runs under a uid of its own.
        root = os.geteuid() == 0 and not plan.get("unprivileged_via")
        processes = cgroup("pids", f"pids.max={limits.get('pids') or 'max'}") or (
            f"RLIMIT_NPROC={rlimits['RLIMIT_NPROC']}" + (" (NOT enforced: root ignores it)" if root else "")
            if "RLIMIT_NPROC" in rlimits else "none"
        )
        memory = cgroup("memory_bytes", f"limit {limits.get('memory_bytes', 0) // 2**20} MiB for the whole "
                        "sandbox, its tmpfs files included")
        address = f"RLIMIT_AS={rlimits['RLIMIT_AS'] // 2**20} MiB per process" if "RLIMIT_AS" in rlimits else ""
        cpu = cgroup("cpus", f"quota {limits.get('cpus')} CPUs")
        cpu_time = f"RLIMIT_CPU={rlimits['RLIMIT_CPU']} s per process" if "RLIMIT_CPU" in rlimits else ""
        disk_bytes = plan.get("disk_bytes")
        if self.record["tmpfs"] and disk_bytes:
            disk = f"tmpfs of {disk_bytes // 2**20} MiB for the workdir and /tmp (writes fail with ENOSPC)"
        elif disk_bytes:
            disk = f"usage polled every 5 s against {disk_bytes // 2**20} MiB; RLIMIT_FSIZE per file"
        else:
            disk = "none"
        return {
            "processes": processes,
            "memory": "; ".join(filter(None, [memory, address])) or "none",
            "cpu": "; ".join(filter(None, [cpu, cpu_time])) or "none",
            "disk": disk,
            "fallback_reason": self.record.get("fallback", ""),
        }

    # -- teardown (supervisor or reaper) -------------------------------------------------
    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup, double-forked or not, and wait until none is left."""
        cgroups = [p for p in self.record["cgroups"] if os.path.isdir(p)]
        if not cgroups:
            return
        first = cgroups[0]
        try:
            _write(os.path.join(first, "cgroup.kill"), "1")  # cgroup v2, Linux >= 5.14
        except OSError:
            pids = self._pids_path()
            if pids is not None:
                try:  # no new forks while we kill (v1 has no cgroup.kill)
                    _write(os.path.join(pids, "pids.max"), "0")
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        delay = 0.0005
        while True:
            left = _procs(first)
            if not left or time.monotonic() > deadline:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def kill_and_remove_cgroups(self, timeout_s: float = 5.0) -> list[str]:
        """Kill what is inside, then remove the cgroups; returns those that would not go."""
        self.kill_all(timeout_s)
        self.close_counters()
        stuck = []
        for path in self.record["cgroups"]:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as error:
                    # EBUSY while killed tasks finish exiting.
                    if error.errno != errno.EBUSY or time.monotonic() > deadline:
                        stuck.append(f"{path}: {error.strerror}")
                        break
                    time.sleep(0.005)
        return stuck

    def release(self) -> list[str]:
        """Kill, unmount, remove: idempotent; returns what could not be removed."""
        stuck = self.kill_and_remove_cgroups()
        tmpfs = self.record.get("tmpfs")
        if tmpfs and _is_mount_point(tmpfs):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.umount2(tmpfs.encode(), _MNT_DETACH) != 0:
                stuck.append(f"{tmpfs}: umount failed ({os.strerror(ctypes.get_errno())})")
        return stuck


def _foreign_parts(record: dict, directory: str) -> list[str]:
    """What a confinement record names that Confinement.create would not have made for the
    sandbox folder `directory`."""
    problems = []
    name = re.compile(re.escape(os.path.basename(directory)) + r"\.[0-9]+")
    delegated = env_setting("CGROUP_ROOT")
    cgroup_mounts = [point for _, point, _, _ in _mountinfo()]
    cgroups = record.get("cgroups")
    for path in cgroups if isinstance(cgroups, list) else [cgroups]:
        parent = os.path.dirname(path) if isinstance(path, str) else ""
        ours = (
            isinstance(path, str) and os.path.normpath(path) == path and name.fullmatch(os.path.basename(path))
            and (os.path.basename(parent) == CGROUP_DIR_NAME or parent == delegated)
            and any(path.startswith(point.rstrip("/") + "/") for point in cgroup_mounts)
        )
        if not ours:
            problems.append(f"cgroup {path!r}, not one of this sandbox's")
    tmpfs = record.get("tmpfs")
    if tmpfs is not None and tmpfs != os.path.join(directory, "data"):
        problems.append(f"mount point {tmpfs!r}, not this sandbox's {os.path.join(directory, 'data')}")
    return problems


def _has_file(path: str, key: str) -> bool:
    name = {"pids": "pids.max", "memory_bytes": "memory.", "cpus": "cpu."}[key]
    if name.endswith("."):
        try:
            return any(entry.startswith(name) for entry in os.listdir(path))
        except OSError:
            return False
    return os.path.exists(os.path.join(path, name))


def _procs(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as handle:
            return [int(line) for line in handle if line.strip()]
    except (OSError, ValueError):
        return []


def _is_mount_point(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as handle:
            return any(line.split()[4] == path for line in handle)
    except OSError:
        return os.path.ismount(path)


def orphaned_mounts() -> list[str]:
    """Our tmpfs mounts whose sandbox folder lost its plan (deleted around the mount)."""
    found = []
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                tail = right.split()
                if len(tail) >= 2 and tail[0] == "tmpfs" and tail[1] == MOUNT_SOURCE.decode():
                    point = left.split()[4]
                    if not os.path.exists(os.path.join(os.path.dirname(point), "plan.json")):
                        found.append(point)
    except OSError:
        pass
    return found


def sweep_orphans() -> list[str]:
    """Unmount and remove what sandboxes whose folder was deleted left behind; returns it.

    A sandbox cgroup is named ID.SUPERVISOR_PID: one whose supervisor is gone and which
    holds no process is an orphan (a live sandbox always has its supervisor).
    """
    released = []
    libc = ctypes.CDLL(None, use_errno=True)
    for point in orphaned_mounts():
        if libc.umount2(point.encode(), _MNT_DETACH) == 0:
            released.append(point)
    found, _ = hierarchies()
    for hierarchy in found:
        try:
            names = os.listdir(hierarchy.base)
        except OSError:
            continue
        for name in names:
            path = os.path.join(hierarchy.base, name)
            pid = name.rpartition(".")[2]
            if not os.path.isdir(path) or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
                continue
            if not _procs(path):
                try:
                    os.rmdir(path)
                    released.append(path)
                except OSError:
                    pass
    return released
