"""The agent's whole workdir, read from the host for the harbor task's verification (harbor_verify.py).

Unlike the SWE task's checkout (verification.read_tree), a Harbor task's state may live anywhere
in its workdir, ``.git`` and caches included (a task may ask to recover a commit): every folder,
regular file and symlink is kept, read as the host without following a symlink (each step opened
O_NOFOLLOW beneath its parent's descriptor); FIFOs, sockets and devices are refused and named.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile

from rollstream.tasks.verification import (
    TREE_MAX_BYTES,
    TREE_MAX_FILES,
    AgentTree,
    VerificationRefused,
)

TREE_MAX_DEPTH = 64
_NO_FOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def read_workdir(host_dir: str, max_bytes: int = TREE_MAX_BYTES, max_files: int = TREE_MAX_FILES) -> AgentTree:
    """The tree under ``host_dir`` as a tar: folders first, then files, symlinks last (so that
    extracting it never writes through one of them)."""
    buffer = io.BytesIO()
    tree = AgentTree(tar=b"")
    links: list[tarfile.TarInfo] = []
    try:
        top = os.open(host_dir, _NO_FOLLOW | os.O_DIRECTORY)
    except OSError as error:
        raise VerificationRefused(f"the agent's workdir cannot be opened as a folder ({error.strerror})") from None
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        try:
            _walk(top, "", tar, links, tree, max_bytes, max_files, 0)
        finally:
            os.close(top)
        for link in links:
            tar.addfile(link)
    tree.tar = buffer.getvalue()
    return tree


def _walk(fd: int, prefix: str, tar: tarfile.TarFile, links: list[tarfile.TarInfo], tree: AgentTree,
          max_bytes: int, max_files: int, depth: int) -> None:
    if depth > TREE_MAX_DEPTH:
        raise VerificationRefused(f"the agent's workdir nests folders deeper than {TREE_MAX_DEPTH} ({prefix})")
    for name in sorted(os.listdir(fd)):
        path = prefix + name
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        tree.files += 1
        if tree.files > max_files:
            raise VerificationRefused(f"the agent's workdir holds more than {max_files} entries; nothing was verified")
        if stat.S_ISDIR(info.st_mode):
            folder = tarfile.TarInfo(path)
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
            child = os.open(name, _NO_FOLLOW | os.O_DIRECTORY, dir_fd=fd)
            try:
                _walk(child, path + "/", tar, links, tree, max_bytes, max_files, depth + 1)
            finally:
                os.close(child)
        elif stat.S_ISLNK(info.st_mode):
            link = tarfile.TarInfo(path)
            link.type, link.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=fd)
            links.append(link)
        elif stat.S_ISREG(info.st_mode):
            tree.bytes += info.st_size
            if tree.bytes > max_bytes:
                raise VerificationRefused(f"the agent's workdir holds more than {max_bytes // 2**20} MiB; nothing "
                                          "was verified")
            _add_file(fd, name, path, tar, max_bytes)
        else:
            kind = "FIFO" if stat.S_ISFIFO(info.st_mode) else "socket" if stat.S_ISSOCK(info.st_mode) else "device"
            tree.refused.append(f"{path} ({kind})")


def _add_file(parent: int, name: str, path: str, tar: tarfile.TarFile, max_bytes: int) -> None:
    fd = os.open(name, _NO_FOLLOW, dir_fd=parent)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since the stat above
            raise VerificationRefused(f"{path} changed kind while the agent's workdir was read")
        data = handle.read(max_bytes + 1)
    member = tarfile.TarInfo(path)
    member.size, member.mode = len(data), stat.S_IMODE(info.st_mode) & 0o755  # never group/other writable
    tar.addfile(member, io.BytesIO(data))
