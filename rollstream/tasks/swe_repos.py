"""The local repository mirror the ``swe`` task reads (no network): finding a repository
at a commit and packing it as a git bundle that init copies into the sandbox. The small
repositories shipped with rollstream (``data/swe/repos/<name>``) are built into the
mirror at first use, deterministically, so their commit ids in ``swe.jsonl`` hold.

Mirror layout: ``<mirror>/<owner>__<name>[.git]`` (a clone, bare or not) or
``<mirror>/<owner>__<name>.bundle``; ``$ROLLSTREAM_SWE_MIRROR`` or ``~/.cache/rollstream/swe-mirror``.

The init worker reads the mirror as root for jobs it does not trust: a mirror or local
repository a job names must lie beneath a folder the operator lists (``MirrorRoots``, setting
``swe_repo_mirrors``), and a bundle is read only as a regular file of bounded size, opened
beneath its root without following a symlink.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rollstream.config import Settings, default_swe_mirror, load_settings
from rollstream.errors import InvalidJob
from rollstream.sandboxes.runtime.editor import open_beneath

SHIPPED_REPOS = Path(__file__).resolve().parent.parent / "data" / "swe" / "repos"
# Real projects' repositories (scripts/build_swe_pypi_instances.py), one bundle each.
SHIPPED_BUNDLES = Path(__file__).resolve().parent.parent / "data" / "swe" / "bundles"
SHIPPED_OWNER = "rollstream"
# Fixed identity and dates make the shipped repositories' commit ids reproducible.
_BUILD_ENV = {
    "GIT_AUTHOR_NAME": "rollstream", "GIT_AUTHOR_EMAIL": "rollstream@example.invalid",
    "GIT_COMMITTER_NAME": "rollstream", "GIT_COMMITTER_EMAIL": "rollstream@example.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "TZ": "UTC",
}


class MirrorError(InvalidJob):
    """The mirror lacks the repository or commit an instance names."""


class MirrorRefused(MirrorError):
    """An instance names a path the operator does not let jobs read: a mirror or repository
    outside the allowed folders, or a bundle that is a symlink, not a regular file, or too big."""


ROOTS_SETTING = "swe_repo_mirrors (ROLLSTREAM_SWE_REPO_MIRRORS, a JSON list)"
DEFAULT_BUNDLE_MAX_BYTES = 1 << 30


def default_mirror() -> Path:
    return default_swe_mirror()


@dataclass(frozen=True)
class MirrorRoots:
    """The folders beneath which a job's mirror and local repository may lie (the operator's
    ``swe_repo_mirrors``), and the largest bundle init reads into a sandbox."""

    roots: tuple[Path, ...]
    bundle_max_bytes: int = DEFAULT_BUNDLE_MAX_BYTES

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> MirrorRoots:
        settings = settings or load_settings()  # the worker's, read when a job needs them
        return cls(tuple(settings.swe_repo_mirrors), settings.swe_bundle_max_bytes)

    def with_root(self, root: Path) -> MirrorRoots:
        """These roots and ``root`` (a mirror the operator named on the command line)."""
        return MirrorRoots((*self.roots, root), self.bundle_max_bytes)

    def root_of(self, path: Path | str) -> Path | None:
        """The allowed root ``path`` lies beneath (or is), symlinks resolved; None if none."""
        if not os.path.isabs(path):
            return None
        real = os.path.realpath(path)
        for root in self.roots:
            top = os.path.realpath(root)
            if real == top or real.startswith(top.rstrip("/") + "/"):
                return Path(top)
        return None

    def check(self, path: Path | str, what: str) -> Path:
        """``path`` if it lies beneath an allowed root, else MirrorRefused naming ``what``."""
        if self.root_of(path) is None:
            raise self._refused(path, what)
        return Path(path)

    def _refused(self, path: Path | str, what: str) -> MirrorRefused:
        return MirrorRefused(f"swe: {what} {str(path)!r} is not beneath a folder the operator allows for "
                             f"mirrors ({', '.join(map(str, self.roots)) or 'none'}); use one of them, or "
                             f"ask the operator to add it to {ROOTS_SETTING}")


def open_bundle(path: Path, roots: MirrorRoots) -> BinaryIO:
    """The bundle at ``path``, open for reading: opened beneath its allowed root (or the shipped
    bundles) without following a symlink, non-blocking, a regular file of at most
    ``roots.bundle_max_bytes``; MirrorRefused otherwise."""
    parent = Path(path).parent
    base = SHIPPED_BUNDLES if parent == SHIPPED_BUNDLES else roots.root_of(parent)
    if base is None:
        raise roots._refused(path, "bundle")
    relative = os.path.relpath(os.path.join(os.path.realpath(parent), Path(path).name), base)
    try:
        fd = open_beneath(str(base), relative, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV, errno.EMLINK):
            raise MirrorRefused(f"swe: bundle {str(path)!r} is a symlink or leaves {base}; a mirror holds "
                                "bundles as plain files") from None
        raise MirrorError(f"swe: cannot open bundle {str(path)!r}: {exc.strerror}") from None
    f = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file (a FIFO, device or folder); a mirror holds bundles as plain files"
    elif info.st_size > roots.bundle_max_bytes:
        problem = (f"has {info.st_size} bytes, more than the {roots.bundle_max_bytes} the operator allows "
                   "(setting swe_bundle_max_bytes)")
    if problem is not None:
        f.close()
        raise MirrorRefused(f"swe: bundle {str(path)!r} {problem}")
    return f


def read_bundle(path: Path, roots: MirrorRoots) -> bytes:
    """The bytes of the bundle at ``path``, checked as ``open_bundle`` checks it."""
    with open_bundle(path, roots) as f:
        data = f.read(roots.bundle_max_bytes + 1)
    if len(data) > roots.bundle_max_bytes:  # it grew while read
        raise MirrorRefused(f"swe: bundle {str(path)!r} grew past {roots.bundle_max_bytes} bytes while read")
    return data


def mirror_name(repo: str) -> str:
    """``owner/name`` -> ``owner__name``, the SWE-bench convention for local copies."""
    if not repo or repo.count("/") != 1 or ".." in repo or repo.startswith("/"):
        raise InvalidJob(f"repo must look like 'owner/name', got {repo!r}")
    return repo.replace("/", "__")


def _git(*args: str, cwd: Path | None = None, env: dict | None = None) -> str:
    result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                            env={**os.environ, **_BUILD_ENV, **(env or {})}, timeout=120)
    if result.returncode != 0:
        raise MirrorError(f"git {' '.join(args[:3])} failed in {cwd}: {result.stderr.strip()[-500:]}")
    return result.stdout.strip()


@contextmanager
def _locked(mirror: Path, roots: MirrorRoots):
    roots.check(mirror, "repo_mirror")
    mirror.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(mirror / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MirrorRefused(f"swe: {mirror / '.lock'} is a symlink; remove it (the mirror's lock is a plain "
                                "file)") from None
        raise
    with os.fdopen(fd, "r+b") as lock:
        if not stat.S_ISREG(os.fstat(lock.fileno()).st_mode):
            raise MirrorRefused(f"swe: {mirror / '.lock'} is not a regular file; remove it")
        fcntl.flock(lock, fcntl.LOCK_EX)  # several worker processes may build at once
        yield


def build_shipped_repo(name: str, dest: Path) -> str:
    """Build the shipped repository ``name`` as a bare repo at ``dest``: one commit of the
    tree in ``data/swe/repos/<name>``. Returns the commit id (the same on every machine)."""
    source = SHIPPED_REPOS / name
    if not source.is_dir():
        raise MirrorError(f"no shipped repository named {name!r} in {SHIPPED_REPOS}")
    with tempfile.TemporaryDirectory(prefix="rs-swe-build-") as tmp:
        work = Path(tmp) / name
        shutil.copytree(source, work, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        for path in work.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)  # modes are part of the tree id
        _git("init", "-q", "-b", "main", cwd=work)
        _git("add", "-A", cwd=work)
        _git("-c", "commit.gpgsign=false", "commit", "-q", "-m", f"{name}: initial version", cwd=work)
        commit = _git("rev-parse", "HEAD", cwd=work)
        staging = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        _git("clone", "-q", "--bare", str(work), str(staging))
        staging.rename(dest)
    return commit


def shipped_repo_names() -> list[str]:
    return sorted(p.name for p in SHIPPED_REPOS.iterdir() if p.is_dir()) if SHIPPED_REPOS.is_dir() else []


def locate(repo: str, mirror: Path, local_path: str | None = None, roots: MirrorRoots | None = None) -> Path:
    """The mirror entry for ``repo`` (``local_path`` itself when the record named a local
    clone or bundle), building it first if it is a shipped repository. ``mirror`` and
    ``local_path`` come from the job: each must lie beneath ``roots`` (default: the
    operator's setting), and so must the entry, symlinks resolved."""
    roots = roots or MirrorRoots.from_settings()
    if local_path:
        entry = roots.check(local_path, "repository path")
        if entry.suffix != ".bundle" and not entry.is_dir():
            raise MirrorError(f"swe: repository path {local_path!r} is neither a git folder nor a .bundle file")
        return entry
    roots.check(mirror, "repo_mirror")
    base = mirror_name(repo)
    for candidate in (mirror / base, mirror / f"{base}.git"):
        if candidate.is_dir():
            return roots.check(candidate, "mirror entry")
    candidate = mirror / f"{base}.bundle"
    if os.path.lexists(candidate):
        return candidate  # read_bundle reads it only as a plain file beneath the mirror's root
    shipped_bundle = SHIPPED_BUNDLES / f"{base}.bundle"
    if shipped_bundle.exists():
        return shipped_bundle
    owner, name = repo.split("/")
    if owner == SHIPPED_OWNER and name in shipped_repo_names():
        with _locked(mirror, roots):
            dest = mirror / f"{base}.git"
            if not dest.exists():
                build_shipped_repo(name, dest)
            return dest
    raise MirrorError(f"repository {repo} is not in the mirror {mirror}; clone it there as "
                      f"{mirror / base} (git clone --mirror URL {mirror / base}.git) or set repo_mirror")


def bundle(repo: str, commit: str, mirror: Path, local_path: str | None = None,
           roots: MirrorRoots | None = None) -> Path:
    """A git bundle of ``repo`` holding ``commit`` (made once, cached in the mirror); read it
    with ``read_bundle``."""
    roots = roots or MirrorRoots.from_settings()
    roots.check(mirror, "repo_mirror")  # the bundle cache lives there
    entry = locate(repo, mirror, local_path, roots)
    if entry.suffix == ".bundle":
        return entry
    if not all(c in "0123456789abcdef" for c in commit.lower()) or not 7 <= len(commit) <= 64:
        raise InvalidJob(f"base_commit must be a hexadecimal commit id, got {commit!r}")
    cached = mirror / ".bundles" / f"{mirror_name(repo)}-{commit}.bundle"
    if cached.exists() or cached.is_symlink():
        return cached
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}", cwd=entry)
    except MirrorError:
        raise MirrorError(f"commit {commit} is not in the mirror of {repo} at {entry}; fetch it there "
                          "(git -C ENTRY fetch --all)") from None
    with _locked(mirror, roots):
        if not cached.exists():
            cached.parent.mkdir(parents=True, exist_ok=True)
            roots.check(cached.parent, "bundle cache")
            staging = cached.with_name(cached.name + f".{os.getpid()}.tmp")
            # A ref naming the commit guarantees it is in the bundle, whatever branches say.
            ref = f"refs/rollstream/base-{commit}"
            _git("update-ref", ref, commit, cwd=entry)
            _git("bundle", "create", str(staging), "--all", cwd=entry)
            staging.rename(cached)
    return cached
