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
    NO_FOLLOW,
    TREE_MAX_BYTES,
    TREE_MAX_DEPTH,
    TREE_MAX_FILES,
    AgentTree,
    VerificationRefused,
    add_file,
    special_kind,
)


def read_workdir(host_dir: str, max_bytes: int = TREE_MAX_BYTES, max_files: int = TREE_MAX_FILES) -> AgentTree:
    """The tree under ``host_dir`` as a tar: folders first, then files, symlinks last (so that
    extracting it never writes through one of them)."""
    buffer = io.BytesIO()
    tree = AgentTree(tar=b"")
    links: list[tarfile.TarInfo] = []
    try:
        top = os.open(host_dir, NO_FOLLOW | os.O_DIRECTORY)
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
            child = os.open(name, NO_FOLLOW | os.O_DIRECTORY, dir_fd=fd)
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
            add_file(fd, name, path, tar, info.st_size, keep_mode=True, what="workdir")
        else:
            tree.refused.append(f"{path} ({special_kind(info.st_mode)})")
