"""Verification in a fresh sandbox: how a task scores an agent's work where the agent cannot
reach. Eval stops the agent's sandbox (every process killed), reads the agent's working tree
from the host side (regular files only, no symlink followed, nothing of the agent's run), then
destroys that sandbox and starts a new one from the same spec under the same id; the task
rebuilds the agent's changes there on a pristine checkout and runs its tests (tasks/swe.py)."""

from __future__ import annotations

import io
import logging
import os
import stat
import tarfile
from dataclasses import dataclass, field

from rollstream.errors import JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxHandle, SandboxSpec
from rollstream.sandboxes.runtime.confine import Confinement
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.base import TaskContext

log = logging.getLogger(__name__)

# The tar travels in one message to the fresh sandbox (frames are at most 256 MiB).
TREE_MAX_BYTES = 192 * 2**20
TREE_MAX_FILES = 200_000
TREE_MAX_DEPTH = 64
# Caches and environments that tools leave in a checkout: never read. A repository that tracks
# such a folder (an sdist's *.egg-info) keeps it as base_commit has it: rebuild_pathspecs().
SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".nox", ".eggs",
                          ".ipynb_checkpoints", ".hypothesis", ".venv", "venv", "node_modules"})
NO_FOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class VerificationRefused(Exception):
    """The agent's tree cannot be verified as it is (too big, too deep); the reward is 0, with this reason."""


@dataclass
class AgentTree:
    """The agent's working tree as a tar of its regular files and symlinks (symlinks last, so
    extracting it never writes through one), and what was refused: special files, hard links."""

    tar: bytes
    files: int = 0
    bytes: int = 0
    refused: list[str] = field(default_factory=list)


def stop_processes(handle: SandboxHandle) -> bool:
    """Kill every process of the agent's sandbox, double-forked ones included, while its files
    stay; True if its cgroup did it. Without a cgroup of ours (an unprivileged node, a container
    backend) processes are killed when the sandbox is destroyed, after its tree is read: until
    then they can change only the agent's own tree."""
    try:
        confinement = Confinement.load(handle.dir)
    except Exception as error:  # a record that is not ours: the destroy still kills everything
        log.warning("sandbox %s: cannot read its confinement record (%s); its processes die with it", handle.id, error)
        return False
    if confinement is None or not confinement.record.get("cgroups"):
        return False
    confinement.kill_all()
    return True


def read_tree(host_dir: str, max_bytes: int = TREE_MAX_BYTES, max_files: int = TREE_MAX_FILES, *,
              whole: bool = False) -> AgentTree:
    """The tree under the host folder ``host_dir`` as a tar, read as the host, never following a
    symlink (every step is opened O_NOFOLLOW beneath its parent's descriptor) and never opening
    anything but regular files and folders; FIFOs, sockets and devices are refused and named.
    Symlinks come last in the tar, so extracting it never writes through one of them.

    The SWE task's checkout (default): ``.git``, caches and ``.pyc`` files are left out and hard
    links refused (a name for a file elsewhere, as symlinks are). ``whole``: a Harbor task's
    workdir, whose state may live anywhere in it (a task may ask to recover a commit): every
    folder (as an entry), ``.git`` and caches kept, files with their own modes."""
    what = "workdir" if whole else "checkout"
    buffer = io.BytesIO()
    tree = AgentTree(tar=b"")
    links: list[tarfile.TarInfo] = []
    try:
        top = os.open(host_dir, NO_FOLLOW | os.O_DIRECTORY)
    except OSError as error:
        raise VerificationRefused(f"the agent's {what} cannot be opened as a folder ({error.strerror})") from None
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        walk = _Walk(tar, links, tree, max_bytes, max_files, whole)
        try:
            walk.folder(top, "", 0)
        except OSError as error:  # an entry swapped mid-read (a symlink for a folder: ELOOP)
            raise VerificationRefused(f"the agent's {what} changed while it was read ({error}); "
                                      "nothing was verified") from None
        finally:
            os.close(top)
        for link in links:
            tar.addfile(link)
    tree.tar = buffer.getvalue()
    return tree


def rebuild_pathspecs() -> list[str]:
    """Git pathspecs that leave what ``read_tree`` skips out of a diff taken from its tar, so a
    tracked cache folder never reads as deleted."""
    return [f":(exclude,glob)**/{name}/**" for name in sorted(SKIPPED_DIRS)] + [
        ":(exclude,glob)**/*.egg-info/**", ":(exclude,glob)**/*.pyc"]


def left_behind(host_workdir: str, checkout: str) -> list[str]:
    """The workdir's entries beside the checkout (``checkout``: its first component): what the
    agent leaves in its sandbox and verification never sees. Names only, nothing opened."""
    try:
        return sorted(name for name in os.listdir(host_workdir) if name != checkout)[:100]
    except OSError as error:
        return [f"(the workdir could not be listed: {error.strerror})"]


@dataclass
class _Walk:
    """One reading of a tree by ``read_tree``: where it writes and what it has counted."""

    tar: tarfile.TarFile
    links: list[tarfile.TarInfo]
    tree: AgentTree
    max_bytes: int
    max_files: int
    whole: bool

    @property
    def what(self) -> str:
        return "workdir" if self.whole else "checkout"

    def folder(self, fd: int, prefix: str, depth: int) -> None:
        if depth > TREE_MAX_DEPTH:
            raise VerificationRefused(f"the agent's {self.what} nests folders deeper than {TREE_MAX_DEPTH} ({prefix})")
        for name in sorted(os.listdir(fd)):
            if not self.whole and name == ".git":  # git's own folder, or the file of a linked worktree
                continue
            self.entry(fd, name, prefix + name, depth)

    def entry(self, fd: int, name: str, path: str, depth: int) -> None:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if self.whole:  # every entry counts (folders and links too), as the workdir holds them
            self.count(0)
        if stat.S_ISDIR(info.st_mode):
            if not self.whole and (name in SKIPPED_DIRS or name.endswith(".egg-info")):
                return
            if self.whole:
                folder = tarfile.TarInfo(path)
                folder.type, folder.mode = tarfile.DIRTYPE, 0o755
                self.tar.addfile(folder)
            child = os.open(name, NO_FOLLOW | os.O_DIRECTORY, dir_fd=fd)
            try:
                self.folder(child, path + "/", depth + 1)
            finally:
                os.close(child)
        elif stat.S_ISLNK(info.st_mode):
            link = tarfile.TarInfo(path)
            link.type, link.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=fd)
            self.links.append(link)
        elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1 and not self.whole:
            self.tree.refused.append(f"{path} (hard link)")  # a name for a file elsewhere, as symlinks are
        elif stat.S_ISREG(info.st_mode):
            if not self.whole and name.endswith(".pyc"):
                return
            self.count(info.st_size, files=0 if self.whole else 1)
            add_file(fd, name, path, self.tar, info.st_size, keep_mode=self.whole, what=self.what)
            if self.tar.offset > self.max_bytes:  # headers count too: many small files
                raise VerificationRefused(f"the agent's {self.what} makes a tar of more than "
                                          f"{self.max_bytes // 2**20} MiB; nothing was verified")
        else:
            self.tree.refused.append(f"{path} ({special_kind(info.st_mode)})")

    def count(self, size: int, files: int = 1) -> None:
        self.tree.files += files
        self.tree.bytes += size
        if self.tree.files > self.max_files or self.tree.bytes > self.max_bytes:
            raise VerificationRefused(f"the agent's {self.what} holds more than {self.max_files} "
                                      f"{'entries' if self.whole else 'files'} or {self.max_bytes // 2**20} MiB; "
                                      "nothing was verified")


def special_kind(mode: int) -> str:
    """What a file that is neither a folder, a regular file nor a symlink is, for a refusal."""
    return "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"


def add_file(parent: int, name: str, path: str, tar: tarfile.TarFile, size: int, *, keep_mode: bool = False,
             what: str = "checkout") -> None:
    """Add the regular file ``name`` of the folder ``parent`` to ``tar`` as ``path``, opened without
    following a symlink; refused if it changed kind or size since it was stat'ed as ``size`` bytes.
    Its mode is 0755/0644 by its execute bits, or with ``keep_mode`` its own without group/other write."""
    fd = os.open(name, NO_FOLLOW, dir_fd=parent)
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped since the stat above
            raise VerificationRefused(f"{path} changed kind while the agent's {what} was read")
        data = handle.read(size + 1)
    if len(data) != size:
        raise VerificationRefused(f"{path} changed size while the agent's {what} was read")
    member = tarfile.TarInfo(path)
    member.size = len(data)
    member.mode = stat.S_IMODE(info.st_mode) & 0o755 if keep_mode else 0o755 if info.st_mode & 0o111 else 0o644
    tar.addfile(member, io.BytesIO(data))


def agent_handle(env: Envelope, ctx: TaskContext) -> SandboxHandle:
    """The job's sandbox as the node knows it (its paths rebuilt from its id, never taken from the message)."""
    handle = ctx.sandboxes.handle(env) if ctx.sandboxes is not None else None
    if handle is None:
        raise JobFailed("eval reached a task that verifies in a fresh sandbox without the job's sandbox or the "
                        "node's sandboxes (TaskContext.sandboxes); the eval stage sets both", retryable=True)
    return handle


def agent_client(ctx: TaskContext) -> SandboxClient:
    """The stage's connection to the agent's sandbox (only for what must be asked inside it)."""
    if ctx.sandbox is None:
        raise JobFailed("eval reached a task that verifies in a fresh sandbox without a connection to the job's "
                        "sandbox (TaskContext.sandbox); the eval stage sets it", retryable=True)
    return ctx.sandbox


async def fresh_sandbox(env: Envelope, ctx: TaskContext, spec: SandboxSpec) -> SandboxClient:
    """Destroy the job's sandbox and start a new one from ``spec`` on the same node, under the
    same id (the node's reaper keeps it as the job's own); returns a connected client. The new
    handle is in ``env.sandbox`` at once, so the stage's release destroys it whatever happens."""
    assert ctx.sandboxes is not None  # agent_handle checked it
    await ctx.sandboxes.destroy(env)
    env.sandbox = None
    env.sandbox = await ctx.sandboxes.create(env, spec)
    return await SandboxClient(env.sandbox.socket_path).connect()
