"""A host uid of its own for each sandbox of a root supervisor, so nothing inside is root on the host.

bubblewrap maps the sandbox's user to the uid that runs it: under a root supervisor that is
host uid 0, and root-only host files (/etc/shadow, a 0600 file in a 0700 folder) would be
readable from inside. A root supervisor therefore takes a uid from a range no account uses,
held by an flock for its whole life (no two live sandboxes share one, so RLIMIT_NPROC counts
per sandbox), hands the sandbox's folders to it, and starts every sandboxed process through
`setpriv` under that uid with no supplementary groups. Stdlib only: it runs in the supervisor.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import Plan
if __package__:
    from .env_settings import env_setting
else:  # python -S supervisor.py: sibling modules are top-level
    from env_settings import env_setting

# Above systemd's container range (524288-1879048191) and below 2^31 (tools that keep uids
# in a signed int); ROLLSTREAM_SANDBOX_UID_BASE / _COUNT move it.
UID_BASE = int(env_setting("SANDBOX_UID_BASE", "1900000000"))
UID_COUNT = int(env_setting("SANDBOX_UID_COUNT", "65536"))
# Node-wide (every sandbox root of the node draws from one range); root-only.
LOCK_DIR = env_setting("SANDBOX_UID_LOCKS", "/run/rollstream-uids")


class HostIdentity:
    """The uid (and same-numbered gid) one sandbox runs under, and the lock that reserves it."""

    def __init__(self, uid: int, lock_fd: int, setpriv: str) -> None:
        self.uid = uid
        self.lock_fd = lock_fd
        self.setpriv = setpriv

    def prefix(self) -> list[str]:
        """What goes before a spawned sandbox command (bwrap ...): drop to this uid, no groups."""
        return [self.setpriv, f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--"]

    def wrap(self, argv: list[str], stage_dir: str) -> list[str]:
        """`argv` (a bwrap command) started under this uid.

        bwrap opens its bind sources as the uid it runs as: a source below a folder others may
        not search (the host's Python under /root, an image in root's cache) is first bound, in
        a mount namespace of this process alone, onto a folder in `stage_dir` that the uid can
        reach. Masks it could not mount are dropped: what they cover is out of its reach anyway.
        """
        out: list[str] = []
        stages: list[str] = []
        options, command = split_options(argv)
        for option, values in options:
            if option in _MASKS and values[-1:] and not searchable_by_others(values[-1]) and (
                    option == "--tmpfs" or values[0] == "/dev/null"):
                continue
            if option in _BINDS and len(values) == 2 and os.path.exists(values[0]) \
                    and not searchable_by_others(values[0]):
                staged = os.path.join(stage_dir, str(len(stages) // 2))
                _make_mount_point(staged, os.path.isdir(values[0]))
                stages += [values[0], staged]
                values = [staged, values[1]]
            out += [option, *values]
        out += command
        if not stages:
            return self.prefix() + out
        unshare, mount = shutil.which("unshare"), shutil.which("mount")
        if not unshare or not mount:
            raise RuntimeError(f"{stages[0]} is below a folder other users cannot search; staging it for "
                               "the sandbox's unprivileged uid needs unshare and mount (util-linux)")
        return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _STAGE_SCRIPT, "sh",
                mount, *stages, "--", *self.prefix(), *out]

    def release(self) -> None:
        try:
            os.close(self.lock_fd)
        except OSError:
            pass


# Options of the bwrap commands we build and how many values each takes (the rest take none).
_ARITY = {"--bind": 2, "--ro-bind": 2, "--bind-try": 2, "--ro-bind-try": 2, "--dev-bind": 2, "--symlink": 2,
          "--setenv": 2, "--chmod": 2, "--tmpfs": 1, "--proc": 1, "--dev": 1, "--dir": 1, "--chdir": 1,
          "--uid": 1, "--gid": 1, "--hostname": 1, "--cap-drop": 1, "--cap-add": 1, "--unsetenv": 1,
          "--remount-ro": 1, "--perms": 1, "--size": 1, "--mqueue": 1}
_BINDS = ("--bind", "--ro-bind", "--bind-try", "--ro-bind-try")
_MASKS = ("--tmpfs", "--ro-bind")
# $1 is mount(8), then SOURCE STAGE pairs up to "--", then the command.
_STAGE_SCRIPT = ('mount=$1; shift; while [ "$1" != "--" ]; do "$mount" --bind "$1" "$2" || exit 126; '
                 'shift 2; done; shift; exec "$@"')


def split_options(argv: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """A bwrap argv as (option, its values) pairs and the command after '--' (with the '--')."""
    options = []
    index = 0
    while index < len(argv) and argv[index] != "--":
        option = argv[index]
        values = argv[index + 1 : index + 1 + _ARITY.get(option, 0)]
        options.append((option, values))
        index += 1 + len(values)
    return options, argv[index:]


def _make_mount_point(path: str, folder: bool) -> None:
    if folder:
        os.makedirs(path, exist_ok=True)
    elif not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))


def _lock_dir() -> str:
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    info = os.lstat(LOCK_DIR)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise RuntimeError(f"{LOCK_DIR} must be a folder owned by root and writable by root only; "
                           "remove it or set ROLLSTREAM_SANDBOX_UID_LOCKS to another folder")
    return LOCK_DIR


def allocate(setpriv: str) -> HostIdentity:
    """A uid no other live sandbox of this node holds; raises RuntimeError when all are taken."""
    folder = _lock_dir()
    start = os.getpid() % UID_COUNT
    for step in range(UID_COUNT):
        slot = (start + step) % UID_COUNT
        fd = os.open(os.path.join(folder, str(slot)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return HostIdentity(UID_BASE + slot, fd, setpriv)
    raise RuntimeError(f"all {UID_COUNT} sandbox uids from {UID_BASE} are in use on this node; "
                       "raise ROLLSTREAM_SANDBOX_UID_COUNT")


def searchable_by_others(path: str) -> bool:
    """True when an unprivileged uid (no groups) can walk down to `path`: every folder above it o+x."""
    current = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            if not os.stat(current).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        if current == "/":
            return True
        current = os.path.dirname(current)


def hand_over(plan: Plan, uid: int) -> None:
    """Give the sandbox's folders to `uid`: it writes the workdir and the kernel folder, walks
    (only) into its sandbox folder, and nobody else but root gets in."""
    directory = plan["dir"]
    root_dir = os.path.dirname(directory)
    for folder in (os.path.dirname(root_dir), root_dir):  # our own folders: search only, names stay unlisted
        info = os.stat(folder)
        if info.st_uid == 0 and (folder == root_dir or os.path.basename(folder).startswith("rollstream-sb-")):
            os.chmod(folder, stat.S_IMODE(info.st_mode) | stat.S_IXOTH)
    if not searchable_by_others(root_dir):
        raise RuntimeError(
            f"the sandbox root {root_dir} is below a folder that other users cannot search (o+x); the "
            "sandbox runs under an unprivileged uid and could not reach its workdir: choose a sandbox "
            "root such as /tmp/rollstream-sb-0 (ROLLSTREAM_SANDBOX_ROOT)")
    data_dir = plan.get("data_dir") or os.path.join(directory, "data")
    os.makedirs(os.path.join(directory, "stage"), exist_ok=True)  # see HostIdentity.wrap
    for path in (directory, data_dir, os.path.join(directory, "stage")):
        os.chown(path, 0, uid)
        os.chmod(path, 0o710)
    for path in (os.path.join(data_dir, "work"), plan["kernel_dir_host"]):
        os.chown(path, uid, uid)
    os.chmod(os.path.join(data_dir, "tmp"), 0o1777)
