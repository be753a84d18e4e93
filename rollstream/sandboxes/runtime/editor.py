"""The editor tool: view / create / str_replace / insert / undo_edit on sandbox files.

Runs in the supervisor on the host side of the workdir bind mount; every path is
resolved (symlinks included) and refused if it leaves the sandbox's folders, and files are
opened beneath their root folder (openat2 RESOLVE_BENEATH) so that a symlink swapped in by
the sandbox between check and open cannot redirect a write of the (root) supervisor.
"""

from __future__ import annotations

import codecs
import ctypes
import errno
import os
import stat
import time
from collections.abc import Callable


class EditorError(Exception):
    """A bad edit request; the message tells the model what to do instead."""


# The editor runs in the supervisor, outside the sandbox's memory limit: it holds at most this
# much of a file (str_replace, insert, create, undo), streams `view`, and gives each call a
# deadline, so no file the sandbox makes (a 1 GB sparse file, a FIFO) can grow or wedge it.
EDIT_MAX_BYTES = 8 * 2**20
HISTORY_MAX_BYTES = 32 * 2**20  # undo history kept per sandbox; the oldest goes first
READ_MAX_BYTES = 64 * 2**20  # read_file without max_bytes
CALL_DEADLINE_S = 20.0
LIST_MAX_ENTRIES = 2000
_CHUNK_BYTES = 2**20


_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x02, 0x08
_openat2_missing = False


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, relative: str, flags: int, mode: int) -> int:
    global _openat2_missing
    if not _openat2_missing:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0,
                       _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
        fd = libc.syscall(_SYS_OPENAT2, dir_fd, relative.encode("utf-8", "surrogateescape"),
                          ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code != errno.ENOSYS:
            raise OSError(code, os.strerror(code), relative)
        _openat2_missing = True  # Linux < 5.6: walk with O_NOFOLLOW, refusing any symlink
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    fd = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            following = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = following
        return os.open(parts[-1] if parts else ".", flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_beneath(root: str, relative: str, flags: int, mode: int = 0o644) -> int:
    """os.open of root/relative that fails (ELOOP/EXDEV) if any step leaves `root`."""
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _openat2(root_fd, relative or ".", flags, mode)
    finally:
        os.close(root_fd)


def makedirs_beneath(root: str, relative: str, owner: int | None = None) -> None:
    """os.makedirs(root/relative, exist_ok=True), one mkdirat at a time beneath `root`; what it
    makes belongs to `owner` (uid and gid) when given."""
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    for index, part in enumerate(parts):
        parent = open_beneath(root, "/".join(parts[:index]), os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(part, 0o755, dir_fd=parent)
            if owner is not None:
                os.chown(part, owner, owner, dir_fd=parent, follow_symlinks=False)
        except FileExistsError:
            pass
        finally:
            os.close(parent)


def _kind_beneath(root: str, relative: str) -> str:
    """What `relative` is (a FIFO, a socket, ...), looked at beneath `root` without following it."""
    try:
        parent = open_beneath(root, os.path.dirname(relative), os.O_PATH | os.O_DIRECTORY)
        try:
            mode = os.stat(os.path.basename(relative), dir_fd=parent, follow_symlinks=False).st_mode
        finally:
            os.close(parent)
    except OSError:
        return "not a regular file"
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink"}


class PathMap:
    """Translates paths as the sandbox sees them into host paths inside its folders."""

    def __init__(self, workdir_inner: str, mounts: list[tuple[str, str]], owner: int | None = None) -> None:
        self.workdir_inner = workdir_inner
        # The sandbox's host uid where it has one (runtime/identity.py): what we create is its.
        self.owner = owner
        # Longest inner prefix first so that /workspace/x never matches a /work mount.
        self.mounts = sorted(mounts, key=lambda pair: len(pair[0]), reverse=True)

    def to_host(self, path: str, allowed_inner: list[str] | None = None) -> str:
        if not path:
            raise EditorError("path is empty; pass a file path such as 'src/main.py'")
        inner = os.path.normpath(os.path.join(self.workdir_inner, path))
        for inner_root, host_root in self.mounts:
            if allowed_inner is not None and inner_root not in allowed_inner:
                continue
            if inner == inner_root or inner.startswith(inner_root.rstrip("/") + "/"):
                host = os.path.join(host_root, os.path.relpath(inner, inner_root))
                real = os.path.realpath(host)
                real_root = os.path.realpath(host_root)
                if real != real_root and not real.startswith(real_root + "/"):
                    raise EditorError(
                        f"{path} resolves (through a symlink) outside {inner_root}; "
                        "edit the file at its real location inside the sandbox"
                    )
                return os.path.normpath(host)
        roots = allowed_inner or [inner_root for inner_root, _ in self.mounts]
        raise EditorError(f"{path} is outside the sandbox; use a path under {', '.join(roots)}")


    def root_of(self, host: str) -> tuple[str, str]:
        """(host root folder, path relative to it) of a host path from `to_host`."""
        for _, host_root in self.mounts:
            root = os.path.normpath(host_root)
            if host == root or host.startswith(root + "/"):
                return root, os.path.relpath(host, root)
        raise EditorError(f"{host} is outside the sandbox's folders")

    def open(self, host: str, flags: int, mode: int = 0o644) -> int:
        """Open a regular file from `to_host` without following anything out of its root.

        Never blocks (O_NONBLOCK: a FIFO opens or fails at once) and refuses whatever is not
        a regular file: a FIFO, socket or device read by the supervisor would hang or stream forever.
        """
        root, relative = self.root_of(host)
        created = False
        try:
            if flags & os.O_CREAT:
                makedirs_beneath(root, os.path.dirname(relative), self.owner)
            if flags & os.O_CREAT and self.owner is not None:
                try:
                    fd = open_beneath(root, relative, flags | os.O_EXCL | os.O_NONBLOCK, mode)
                    created = True
                except FileExistsError:
                    fd = open_beneath(root, relative, (flags & ~os.O_CREAT) | os.O_NONBLOCK, mode)
            else:
                fd = open_beneath(root, relative, flags | os.O_NONBLOCK, mode)
        except OSError as error:
            if error.errno in (errno.EXDEV, errno.ELOOP):
                raise EditorError(
                    f"{relative} resolves (through a symlink) outside the sandbox; use its real path"
                ) from None
            if error.errno == errno.ENXIO:  # a socket, or O_WRONLY on a FIFO without a reader
                raise EditorError(f"{relative} is {_kind_beneath(root, relative)}, not a regular file; the "
                                  "editor and file calls only handle regular files") from None
            raise
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            os.close(fd)
            raise EditorError(f"{relative} is {_KINDS.get(kind, 'not a regular file')}, not a regular file; "
                              "the editor and file calls only handle regular files")
        if created and self.owner is not None:  # created: only where there is an owner
            os.fchown(fd, self.owner, self.owner)
        return fd

    def read_bytes(self, host: str, max_bytes: int = -1, limit: int = READ_MAX_BYTES) -> bytes:
        """At most `max_bytes`; without it (or past `limit`) the whole file, refused past `limit`
        bytes (never read)."""
        with os.fdopen(self.open(host, os.O_RDONLY), "rb") as handle:
            if max_bytes is None or max_bytes < 0 or max_bytes > limit:
                size = os.fstat(handle.fileno()).st_size
                if size > limit:
                    raise EditorError(f"{os.path.basename(host)} is {size:,} bytes, more than the {limit:,} "
                                      "bytes handled at once; read a part (max_bytes) or use bash "
                                      "(head, tail, sed -n, grep)")
                data = handle.read(limit + 1)
                if len(data) > limit:  # grew while we read
                    raise EditorError(f"{os.path.basename(host)} grew past {limit:,} bytes while being read")
                return data
            return handle.read(max_bytes)

    def write_bytes(self, host: str, data: bytes, mode: int | None = None) -> None:
        with os.fdopen(self.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as handle:
            handle.write(data)
            if mode is not None:
                os.fchmod(handle.fileno(), mode)


class Editor:
    """Text edits with a per-file undo history."""

    def __init__(self, paths: PathMap, output_bytes: int) -> None:
        self.paths = paths
        self.output_bytes = output_bytes
        self.history: dict[str, list[bytes | None]] = {}
        self.history_order: list[str] = []  # host path of each undo entry, oldest first
        self.history_bytes = 0

    def _host(self, path: str) -> str:
        return self.paths.to_host(path, allowed_inner=[self.paths.workdir_inner])

    def _is_dir(self, host: str) -> bool:
        """Whether `host` is a folder, judged beneath the sandbox root (a symlink is not followed)."""
        root, relative = self.paths.root_of(host)
        try:
            os.close(open_beneath(root, relative, os.O_PATH | os.O_DIRECTORY))
            return True
        except OSError:
            return False

    def _read_text(self, host: str, path: str) -> str:
        if self._is_dir(host):
            raise EditorError(f"{path} is a directory; this command needs a file")
        try:
            data = self.paths.read_bytes(host, limit=EDIT_MAX_BYTES)
        except FileNotFoundError:
            raise EditorError(f"{path} does not exist; create it with command='create'") from None
        except EditorError as error:
            raise EditorError(f"{error} (the editor edits files up to {EDIT_MAX_BYTES:,} bytes)") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError(f"{path} is not UTF-8 text; inspect it with bash instead") from None

    def _write(self, host: str, text: str) -> None:
        data = text.encode("utf-8")
        if len(data) > EDIT_MAX_BYTES:
            raise EditorError(f"the new content is {len(data):,} bytes; the editor writes files up to "
                              f"{EDIT_MAX_BYTES:,} bytes (write larger ones with bash)")
        previous: bytes | None = None
        try:
            previous = self.paths.read_bytes(host, limit=EDIT_MAX_BYTES)
        except FileNotFoundError:
            pass
        self.paths.write_bytes(host, data)
        self._remember(host, previous)

    def _remember(self, host: str, previous: bytes | None) -> None:
        """Keep `previous` for undo_edit, dropping the oldest entries past HISTORY_MAX_BYTES."""
        self.history.setdefault(host, []).append(previous)
        self.history_order.append(host)
        self.history_bytes += len(previous or b"")
        while self.history_bytes > HISTORY_MAX_BYTES and self.history_order:
            oldest = self.history_order.pop(0)
            entries = self.history.get(oldest)
            if entries:
                self.history_bytes -= len(entries.pop(0) or b"")

    def _cap(self, text: str) -> str:
        data = text.encode("utf-8")
        if len(data) <= self.output_bytes:
            return text
        half = self.output_bytes // 2
        elided = len(data) - 2 * half
        return (
            data[:half].decode("utf-8", "ignore")
            + f"\n[... {elided:,} bytes elided; view a smaller range ...]\n"
            + data[-half:].decode("utf-8", "ignore")
        )

    def run(self, command: str, path: str, **args: object) -> str:
        handlers: dict[str, Callable[..., str]] = {
            "view": self.view,
            "create": self.create,
            "str_replace": self.str_replace,
            "insert": self.insert,
            "undo_edit": self.undo_edit,
        }
        handler = handlers.get(command)
        if handler is None:
            raise EditorError(
                f"unknown editor command {command!r}; use one of view, create, str_replace, "
                "insert, undo_edit"
            )
        try:
            return handler(path, **{k: v for k, v in args.items() if v is not None})
        except TypeError as error:
            raise EditorError(f"bad arguments for {command}: {error}") from None

    def view(self, path: str, view_range: list[int] | None = None) -> str:
        host = self._host(path)
        if self._is_dir(host):
            if view_range is not None:
                raise EditorError("view_range applies to files, not directories")
            return self._cap(self._list_dir(host, path))
        start, end = 1, -1
        if view_range is not None:
            if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
                raise EditorError("view_range must be two integers [start, end]; end -1 means to the end")
            start, end = view_range
        try:
            fd = self.paths.open(host, os.O_RDONLY)
        except FileNotFoundError:
            raise EditorError(f"{path} does not exist; create it with command='create'") from None
        with os.fdopen(fd, "rb") as handle:
            shown, total = self._numbered_lines(handle, path, start, end)
        if view_range is not None:
            last = total if end == -1 else end
            if not 1 <= start <= max(total, 1) or last < start or last > total:
                raise EditorError(
                    f"view_range {view_range} is outside the file's {total} lines; "
                    f"use 1 <= start <= end <= {total} (or end = -1)"
                )
        return shown

    def _numbered_lines(self, handle, path: str, start: int, end: int) -> tuple[str, int]:
        """Lines start..end (-1: the last) numbered, in at most output_bytes (head and tail kept),
        and the file's line count; reads in chunks, so memory stays bounded whatever the file's size."""
        deadline = time.monotonic() + CALL_DEADLINE_S
        decoder = codecs.getincrementaldecoder("utf-8")()
        output = _HeadTail(self.output_bytes)
        number, pending, cut = 0, "", False
        while True:
            chunk = handle.read(_CHUNK_BYTES)
            try:
                text = pending + decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError:
                raise EditorError(f"{path} is not UTF-8 text; inspect it with bash instead") from None
            lines = text.split("\n")
            pending = lines.pop()  # an unfinished line waits for the next chunk
            for line in lines:
                number += 1
                if number >= start and (end == -1 or number <= end):
                    output.add(f"{number:6}\t{line}" + (" [... rest of this long line cut ...]" if cut else ""))
                cut = False
            if len(pending) > self.output_bytes:  # one huge line (a sparse file): keep what can be shown
                pending, cut = pending[: self.output_bytes], True
            if not chunk:
                break
            if end != -1 and number >= end:  # the rest is not shown, only counted for the range check
                return output.render(), self._count_rest(handle, number, pending, deadline)
            if time.monotonic() > deadline:
                raise EditorError(f"viewing {path} took longer than {CALL_DEADLINE_S:g} s; view a smaller "
                                  "range or use bash (head, sed -n)")
        if pending:
            number += 1
            if number >= start and (end == -1 or number <= end):
                output.add(f"{number:6}\t{pending}" + (" [... rest of this long line cut ...]" if cut else ""))
        return output.render(), number

    @staticmethod
    def _count_rest(handle, number: int, pending: str, deadline: float) -> int:
        """Lines up to the end of the file (for the range check), counted without keeping them."""
        unfinished = bool(pending)  # text after the last newline so far
        while True:
            chunk = handle.read(_CHUNK_BYTES)
            if not chunk:
                return number + unfinished
            newlines = chunk.count(b"\n")
            number += newlines
            unfinished = bool(chunk.rpartition(b"\n")[2]) if newlines else (unfinished or bool(chunk))
            if time.monotonic() > deadline:
                return number  # a range that fits so far is shown; the count stays a lower bound

    def _list_dir(self, host: str, path: str) -> str:
        """Two levels of the folder, hidden names left out, walked by file descriptor beneath the
        sandbox root (a folder swapped for a symlink mid-walk is not followed out of it)."""
        root, relative = self.paths.root_of(host)
        entries = [path.rstrip("/") + "/"]
        deadline = time.monotonic() + CALL_DEADLINE_S
        top = open_beneath(root, relative, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for folder, dirs, files, _ in os.fwalk(".", dir_fd=top):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                if folder.count("/") >= 2:
                    dirs[:] = []
                for name in dirs:
                    entries.append(os.path.normpath(os.path.join(path, folder, name)) + "/")
                entries += [os.path.normpath(os.path.join(path, folder, name)) for name in sorted(files)
                            if not name.startswith(".")]
                if len(entries) > LIST_MAX_ENTRIES or time.monotonic() > deadline:
                    entries = entries[:LIST_MAX_ENTRIES]
                    entries.append(f"[... more entries not listed; list {path} with bash (ls, find)]")
                    break
        finally:
            os.close(top)
        return "\n".join(entries)

    def create(self, path: str, file_text: str) -> str:
        host = self._host(path)
        if self._is_dir(host):
            raise EditorError(f"{path} is a directory; pick a file name inside it")
        self._write(host, file_text)
        return f"File created at {path} ({len(file_text.splitlines())} lines)."

    def str_replace(self, path: str, old_str: str, new_str: str = "") -> str:
        host = self._host(path)
        text = self._read_text(host, path)
        if not old_str:
            raise EditorError("old_str is empty; pass the exact text to replace")
        count = text.count(old_str)
        if count == 0:
            raise EditorError(
                f"old_str was not found in {path}; view the file and copy the text exactly, "
                "including whitespace and indentation"
            )
        if count > 1:
            lines = [str(text[: i].count("\n") + 1) for i in _find_all(text, old_str)]
            raise EditorError(
                f"old_str occurs {count} times in {path} (lines {', '.join(lines)}); include more "
                "surrounding lines so that it matches exactly once"
            )
        new_text = text.replace(old_str, new_str, 1)
        self._write(host, new_text)
        first = text[: text.index(old_str)].count("\n") + 1
        return f"The file {path} has been edited.\n" + self._snippet(new_text, first, new_str.count("\n"))

    def insert(self, path: str, insert_line: int, new_str: str = "", insert_text: str | None = None) -> str:
        host = self._host(path)
        text = self._read_text(host, path)
        new_str = insert_text if insert_text is not None else new_str
        lines = text.split("\n")
        trailing = text.endswith("\n")
        if trailing:
            lines.pop()
        if not isinstance(insert_line, int) or not 0 <= insert_line <= len(lines):
            raise EditorError(
                f"insert_line {insert_line!r} is outside 0..{len(lines)}; 0 inserts at the top, "
                f"{len(lines)} at the end"
            )
        added = new_str.split("\n")
        if new_str.endswith("\n"):
            added.pop()
        lines[insert_line:insert_line] = added
        new_text = "\n".join(lines) + ("\n" if trailing or not lines else "")
        self._write(host, new_text)
        return f"The file {path} has been edited.\n" + self._snippet(new_text, insert_line + 1, len(added))

    def undo_edit(self, path: str) -> str:
        host = self._host(path)
        history = self.history.get(host)
        if not history:
            raise EditorError(f"no edit of {path} to undo")
        previous = history.pop()
        if previous is None:
            root, relative = self.paths.root_of(host)
            parent = open_beneath(root, os.path.dirname(relative), os.O_PATH | os.O_DIRECTORY)
            try:
                os.unlink(os.path.basename(relative), dir_fd=parent)
            finally:
                os.close(parent)
            return f"Undid the creation of {path}; the file is removed."
        self.paths.write_bytes(host, previous)
        return f"Last edit to {path} undone."

    def _snippet(self, text: str, first_line: int, changed_lines: int, context: int = 4) -> str:
        lines = text.split("\n")
        start = max(1, first_line - context)
        end = min(len(lines), first_line + changed_lines + context)
        return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))


class _HeadTail:
    """Lines of a view kept within `cap` bytes: the first half and the last half, the middle counted."""

    def __init__(self, cap: int) -> None:
        self.half = max(cap // 2, 1)
        self.head: list[str] = []
        self.head_bytes = 0
        self.tail: list[str] = []
        self.tail_bytes = 0
        self.elided = 0

    def add(self, line: str) -> None:
        size = len(line.encode("utf-8", "surrogatepass")) + 1
        if not self.tail and self.head_bytes < self.half:
            room = self.half - self.head_bytes
            if size > room:  # the line that fills the head: keep its start
                line = line.encode("utf-8", "surrogatepass")[: room - 1].decode("utf-8", "ignore")
                self.elided += size - room
                size = room
            self.head.append(line)
            self.head_bytes += size
            return
        self.tail.append(line)
        self.tail_bytes += size
        while self.tail_bytes > self.half and len(self.tail) > 1:
            dropped = self.tail.pop(0)
            self.tail_bytes -= len(dropped.encode("utf-8", "surrogatepass")) + 1
            self.elided += len(dropped.encode("utf-8", "surrogatepass")) + 1
        if self.tail_bytes > self.half:  # one line longer than half the cap: keep its end
            self.elided += self.tail_bytes - self.half
            self.tail[0] = self.tail[0].encode()[-self.half:].decode("utf-8", "ignore")
            self.tail_bytes = self.half

    def render(self) -> str:
        if not self.elided:
            return "\n".join(self.head + self.tail)
        return ("\n".join(self.head) + f"\n[... {self.elided:,} bytes elided; view a smaller range ...]\n"
                + "\n".join(self.tail))


def _find_all(text: str, needle: str) -> list[int]:
    positions, start = [], text.find(needle)
    while start != -1:
        positions.append(start)
        start = text.find(needle, start + 1)
    return positions
