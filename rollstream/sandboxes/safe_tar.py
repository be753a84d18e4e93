"""Unpacking an image tarball into a rootfs folder without trusting the archive (images.py).

One code path on every Python version (tarfile's ``filter=`` is missing before 3.11.4, and
Debian 12 ships 3.11.2). Every entry is created relative to a folder descriptor opened
component by component with ``O_NOFOLLOW``, so no symlink, earlier extracted or not, is ever
followed on the host. What the archive cannot make:

- names that are absolute or hold ``..``: the archive is refused;
- hard links to anything but a regular file already extracted: refused;
- symlinks that climb above the folder: refused; absolute targets are rewritten relative to
  the link's own folder (the same file inside the image, never a host file from outside it);
- device nodes and FIFOs: skipped;
- setuid/setgid/sticky bits and group/other write: stripped;
- owners: every entry belongs to the user who unpacks (the archive's uids are ignored).
"""

from __future__ import annotations

import logging
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MODE_MASK = 0o755  # no setuid/setgid/sticky, no group/other write
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SYMLINK_HOPS = 40  # as the kernel's MAXSYMLINKS
_LATEST_MTIME = 2**33


class UnsafeArchive(ValueError):
    """The archive asks for something outside its folder; nothing of it is kept."""


@dataclass
class Unpacked:
    """What `extract` did: entries written and the special files it left out."""

    entries: int = 0
    skipped_special: list[str] = field(default_factory=list)


def _parts(name: str, member: str, what: str = "name") -> list[str]:
    if name.startswith("/"):
        raise UnsafeArchive(f"archive member {member!r} has an absolute {what}; refusing the whole archive")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"archive member {member!r} has '..' in its {what}; refusing the whole archive")
    return parts


class _Tree:
    """Folder descriptors beneath the destination, never through a symlink."""

    def __init__(self, destination: str) -> None:
        self.root = os.open(destination, _DIR_FLAGS)

    def close(self) -> None:
        os.close(self.root)

    def open_dir(self, parts: list[str], member: str, create: bool) -> int:
        """A descriptor of the folder `parts` (missing ones made when `create`); the caller closes it."""
        fd = os.dup(self.root)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except (NotADirectoryError, FileNotFoundError, OSError) as error:
                    raise UnsafeArchive(f"archive member {member!r} goes through {part!r}, which is not a folder "
                                        f"of the archive (a symlink or a file): {error.strerror}") from error
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd


def _clear(parent: int, name: str, member: str, keep_dir: bool) -> bool:
    """Remove an earlier entry `name` that a later member replaces; True when a folder stays."""
    try:
        existing = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(existing.st_mode):
        if keep_dir:
            return True
        raise UnsafeArchive(f"archive member {member!r} would replace a folder of the archive")
    os.unlink(name, dir_fd=parent)
    return False


def _symlink_target(target: str, depth: int, member: str) -> str:
    """`target` as a link at `depth` folders below the root may hold it: relative, never above the root."""
    if target.startswith("/"):
        inner = [part for part in target.split("/") if part not in ("", ".")]
        target = posixpath.join(*([".."] * depth + inner)) if depth + len(inner) else "."
    level = depth
    for part in target.split("/"):
        if part == "..":
            level -= 1
            if level < 0:
                raise UnsafeArchive(f"archive member {member!r} is a symlink to {target!r}, "
                                    "which climbs out of the archive's folder")
        elif part not in ("", "."):
            level += 1
    return target


def _write_file(archive: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
    source = archive.extractfile(member)
    if source is None:
        raise UnsafeArchive(f"archive member {member.name!r} has no data to read")
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
    try:
        with source, os.fdopen(os.dup(fd), "wb") as out:
            while chunk := source.read(1 << 20):
                out.write(chunk)
        os.fchmod(fd, member.mode & MODE_MASK)
        os.utime(fd, _times(member))
    finally:
        os.close(fd)


def _times(member: tarfile.TarInfo) -> tuple[int, int]:
    mtime = min(max(int(member.mtime), 0), _LATEST_MTIME)  # an absurd mtime must not stop the unpacking
    return mtime, mtime


def _escapes(tree: _Tree, parts: list[str]) -> bool:
    """Whether following the symlink at `parts` on the host leaves the tree (with the tree as it is now)."""
    pending = list(parts)
    resolved: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return True
            resolved.pop()
            continue
        parent = tree.open_dir(resolved, "/".join(parts), create=False) if resolved else os.dup(tree.root)
        try:
            try:
                info = os.stat(part, dir_fd=parent, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return False  # dangling: the host finds nothing there
            if stat.S_ISDIR(info.st_mode):
                resolved.append(part)
                continue
            if not stat.S_ISLNK(info.st_mode):
                return False  # a file: the host ends there, or gets ENOTDIR
            hops += 1
            if hops > _SYMLINK_HOPS:
                return False  # a loop: the host gets ELOOP
            target = os.readlink(part, dir_fd=parent)
        finally:
            os.close(parent)
        if target.startswith("/"):
            return True
        pending = target.split("/") + pending
    return False


def extract(tarball: str, destination: str) -> Unpacked:
    """Unpack `tarball` into the existing, empty folder `destination` under the rules above.

    Raises UnsafeArchive naming the first member that breaks them; the caller removes the
    folder (images.py unpacks into a `.partial` folder it renames only on success)."""
    done = Unpacked()
    tree = _Tree(destination)
    folders: dict[tuple[str, ...], tarfile.TarInfo] = {}
    links: list[list[str]] = []
    try:
        with tarfile.open(tarball) as archive:
            for member in archive:
                parts = _parts(member.name, member.name)
                if not parts:
                    continue  # the archive's own root: the destination keeps its mode
                if member.ischr() or member.isblk() or member.isfifo():
                    done.skipped_special.append(member.name)
                    continue
                parent = tree.open_dir(parts[:-1], member.name, create=True)
                name = parts[-1]
                try:
                    if member.isdir():
                        if not _clear(parent, name, member.name, keep_dir=True):
                            os.mkdir(name, 0o700, dir_fd=parent)
                        folders[tuple(parts)] = member
                    elif member.issym():
                        target = _symlink_target(member.linkname, len(parts) - 1, member.name)
                        _clear(parent, name, member.name, keep_dir=False)
                        os.symlink(target, name, dir_fd=parent)
                        links.append(parts)
                    elif member.islnk():
                        _hard_link(tree, parent, name, member)
                    elif member.isreg():
                        _clear(parent, name, member.name, keep_dir=False)
                        _write_file(archive, member, parent, name)
                    else:
                        done.skipped_special.append(member.name)
                        continue
                finally:
                    os.close(parent)
                done.entries += 1
        for parts in links:
            if _escapes(tree, parts):
                raise UnsafeArchive(f"archive member {'/'.join(parts)!r} is a symlink that, followed on the host, "
                                    "leaves the archive's folder")
        # Folders last and deepest first, so that a read-only folder was still writable while filled.
        for parts_key in sorted(folders, key=len, reverse=True):
            fd = tree.open_dir(list(parts_key), "/".join(parts_key), create=False)
            try:
                os.fchmod(fd, folders[parts_key].mode & MODE_MASK)
                os.utime(fd, _times(folders[parts_key]))
            finally:
                os.close(fd)
    finally:
        tree.close()
    if done.skipped_special:
        log.info("unpacking %s left out %d device node(s)/FIFO(s), e.g. %s", tarball, len(done.skipped_special),
                 done.skipped_special[0])
    return done


def _hard_link(tree: _Tree, parent: int, name: str, member: tarfile.TarInfo) -> None:
    target = _parts(member.linkname, member.name, what="link target")
    if not target:
        raise UnsafeArchive(f"archive member {member.name!r} is a hard link to the archive's root")
    if target == _parts(member.name, member.name):
        return  # a link to itself: the file is there already
    source = tree.open_dir(target[:-1], member.name, create=False)
    try:
        try:
            info = os.stat(target[-1], dir_fd=source, follow_symlinks=False)
        except FileNotFoundError as error:
            raise UnsafeArchive(f"archive member {member.name!r} is a hard link to {member.linkname!r}, "
                                "which the archive has not extracted before it") from error
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeArchive(f"archive member {member.name!r} is a hard link to {member.linkname!r}, "
                                "which is not a regular file")
        _clear(parent, name, member.name, keep_dir=False)
        os.link(target[-1], name, src_dir_fd=source, dst_dir_fd=parent, follow_symlinks=False)
    finally:
        os.close(source)
