"""What a harness's sandbox may leave on this host, found from outside as an operator would: live
processes (by a marker in their command line), and a torn-down sandbox's folder files, tmpfs
mount and cgroups."""

from __future__ import annotations

import os

import psutil

from rollstream.sandboxes.runtime.confine import MOUNT_SOURCE


def alive(marker: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose command line holds ``marker``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(process.info["cmdline"] or []) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def left_behind(sandbox_root: str, sandbox_id: str) -> dict[str, list[str]]:
    """What of sandbox ``sandbox_id`` is still on this host: processes naming it, files (sockets
    included) in its folder, its tmpfs mount, its cgroups ('<id>.<pid>' under a 'rollstream' one)."""
    left: dict[str, list[str]] = {"processes": [], "files": [], "mounts": [], "cgroups": []}
    folder = os.path.join(sandbox_root, sandbox_id)
    for process in alive(folder) + alive(sandbox_id):
        try:
            left["processes"].append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    for top, _dirs, files in os.walk(folder):
        left["files"] += [os.path.join(top, name) for name in files]
    with open("/proc/self/mountinfo", "rb") as handle:
        left["mounts"] = [line.decode() for line in handle if MOUNT_SOURCE in line and folder.encode() in line]
    for top, dirs, _files in os.walk("/sys/fs/cgroup"):
        left["cgroups"] += [os.path.join(top, d) for d in dirs if d.startswith(f"{sandbox_id}.")]
        dirs[:] = [d for d in dirs if d == "rollstream" or top.count("/") < 6]
    return {kind: paths for kind, paths in left.items() if paths}
