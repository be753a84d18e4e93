"""The editor tool: view / create / str_replace / insert / undo_edit on sandbox files.

Runs in the supervisor on the host side of the workdir bind mount; every path is
resolved (symlinks included) and refused if it leaves the sandbox's folders, and files are
opened beneath their root folder (openat2 RESOLVE_BENEATH) so that a symlink swapped in by
the sandbox between check and open cannot redirect a write of the (root) supervisor.
"""

from __future__ import annotations

import ctypes
import errno
import os


class EditorError(Exception):
    """A bad edit request; the message tells the model what to do instead."""


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


def makedirs_beneath(root: str, relative: str) -> None:
    """os.makedirs(root/relative, exist_ok=True), one mkdirat at a time beneath `root`."""
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    for index, part in enumerate(parts):
        parent = open_beneath(root, "/".join(parts[:index]), os.O_PATH | os.O_DIRECTORY)
        try:
            os.mkdir(part, 0o755, dir_fd=parent)
        except FileExistsError:
            pass
        finally:
            os.close(parent)


class PathMap:
    """Translates paths as the sandbox sees them into host paths inside its folders."""

    def __init__(self, workdir_inner: str, mounts: list[tuple[str, str]]) -> None:
        self.workdir_inner = workdir_inner
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
        """Open a path from `to_host` without following anything out of its root."""
        root, relative = self.root_of(host)
        try:
            if flags & os.O_CREAT:
                makedirs_beneath(root, os.path.dirname(relative))
            return open_beneath(root, relative, flags, mode)
        except OSError as error:
            if error.errno in (errno.EXDEV, errno.ELOOP):
                raise EditorError(
                    f"{relative} resolves (through a symlink) outside the sandbox; use its real path"
                ) from None
            raise

    def read_bytes(self, host: str, max_bytes: int = -1) -> bytes:
        with os.fdopen(self.open(host, os.O_RDONLY), "rb") as handle:
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

    def _host(self, path: str) -> str:
        return self.paths.to_host(path, allowed_inner=[self.paths.workdir_inner])

    def _read_text(self, host: str, path: str) -> str:
        if os.path.isdir(host):
            raise EditorError(f"{path} is a directory; this command needs a file")
        try:
            return self.paths.read_bytes(host).decode("utf-8")
        except FileNotFoundError:
            raise EditorError(f"{path} does not exist; create it with command='create'") from None
        except UnicodeDecodeError:
            raise EditorError(f"{path} is not UTF-8 text; inspect it with bash instead") from None

    def _write(self, host: str, text: str) -> None:
        previous: bytes | None = None
        try:
            previous = self.paths.read_bytes(host)
        except FileNotFoundError:
            pass
        self.paths.write_bytes(host, text.encode("utf-8"))
        self.history.setdefault(host, []).append(previous)

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

    def run(self, command: str, path: str, **args) -> str:
        handler = {
            "view": self.view,
            "create": self.create,
            "str_replace": self.str_replace,
            "insert": self.insert,
            "undo_edit": self.undo_edit,
        }.get(command)
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
        if os.path.isdir(host):
            if view_range is not None:
                raise EditorError("view_range applies to files, not directories")
            return self._cap(self._list_dir(host, path))
        text = self._read_text(host, path)
        lines = text.split("\n")
        if text.endswith("\n"):
            lines.pop()
        start, end = 1, len(lines)
        if view_range is not None:
            if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range):
                raise EditorError("view_range must be two integers [start, end]; end -1 means to the end")
            start, end = view_range
            if end == -1:
                end = len(lines)
            if not 1 <= start <= max(len(lines), 1) or end < start or end > len(lines):
                raise EditorError(
                    f"view_range {view_range} is outside the file's {len(lines)} lines; "
                    f"use 1 <= start <= end <= {len(lines)} (or end = -1)"
                )
        numbered = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))
        return self._cap(numbered)

    def _list_dir(self, host: str, path: str) -> str:
        entries = [path.rstrip("/") + "/"]
        base_depth = host.rstrip("/").count("/")
        for root, dirs, files in os.walk(host):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            depth = root.rstrip("/").count("/") - base_depth
            if depth >= 2:
                dirs[:] = []
            rel = os.path.relpath(root, host)
            for name in dirs:
                entries.append(os.path.normpath(os.path.join(path, rel, name)) + "/")
            for name in sorted(files):
                if not name.startswith("."):
                    entries.append(os.path.normpath(os.path.join(path, rel, name)))
        return "\n".join(entries)

    def create(self, path: str, file_text: str) -> str:
        host = self._host(path)
        if os.path.isdir(host):
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


def _find_all(text: str, needle: str) -> list[int]:
    positions, start = [], text.find(needle)
    while start != -1:
        positions.append(start)
        start = text.find(needle, start + 1)
    return positions
