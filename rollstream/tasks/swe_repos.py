"""The local repository mirror the ``swe`` task reads (no network): finding a repository
at a commit and packing it as a git bundle that init copies into the sandbox. The small
repositories shipped with rollstream (``data/swe/repos/<name>``) are built into the
mirror at first use, deterministically, so their commit ids in ``swe.jsonl`` hold.

Mirror layout: ``<mirror>/<owner>__<name>[.git]`` (a clone, bare or not) or
``<mirror>/<owner>__<name>.bundle``; ``$ROLLSTREAM_SWE_MIRROR`` or ``~/.cache/rollstream/swe-mirror``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from rollstream.errors import InvalidJob

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


def default_mirror() -> Path:
    return Path(os.environ.get("ROLLSTREAM_SWE_MIRROR") or Path.home() / ".cache" / "rollstream" / "swe-mirror")


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
def _locked(mirror: Path):
    mirror.mkdir(parents=True, exist_ok=True)
    with open(mirror / ".lock", "w") as lock:
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


def locate(repo: str, mirror: Path, local_path: str | None = None) -> Path:
    """The mirror entry for ``repo`` (``local_path`` itself when the record named a local
    clone or bundle), building it first if it is a shipped repository."""
    if local_path:
        return Path(local_path)
    base = mirror_name(repo)
    for candidate in (mirror / base, mirror / f"{base}.git", mirror / f"{base}.bundle"):
        if candidate.exists():
            return candidate
    shipped_bundle = SHIPPED_BUNDLES / f"{base}.bundle"
    if shipped_bundle.exists():
        return shipped_bundle
    owner, name = repo.split("/")
    if owner == SHIPPED_OWNER and name in shipped_repo_names():
        with _locked(mirror):
            dest = mirror / f"{base}.git"
            if not dest.exists():
                build_shipped_repo(name, dest)
            return dest
    raise MirrorError(f"repository {repo} is not in the mirror {mirror}; clone it there as "
                      f"{mirror / base} (git clone --mirror URL {mirror / base}.git) or set repo_mirror")


def bundle(repo: str, commit: str, mirror: Path, local_path: str | None = None) -> Path:
    """A git bundle of ``repo`` holding ``commit`` (made once, cached in the mirror)."""
    entry = locate(repo, mirror, local_path)
    if entry.suffix == ".bundle":
        return entry
    if not all(c in "0123456789abcdef" for c in commit.lower()) or not 7 <= len(commit) <= 64:
        raise InvalidJob(f"base_commit must be a hexadecimal commit id, got {commit!r}")
    cached = mirror / ".bundles" / f"{mirror_name(repo)}-{commit}.bundle"
    if cached.exists():
        return cached
    try:
        _git("cat-file", "-e", f"{commit}^{{commit}}", cwd=entry)
    except MirrorError:
        raise MirrorError(f"commit {commit} is not in the mirror of {repo} at {entry}; fetch it there "
                          "(git -C ENTRY fetch --all)") from None
    with _locked(mirror):
        if not cached.exists():
            cached.parent.mkdir(parents=True, exist_ok=True)
            staging = cached.with_name(cached.name + f".{os.getpid()}.tmp")
            # A ref naming the commit guarantees it is in the bundle, whatever branches say.
            ref = f"refs/rollstream/base-{commit}"
            _git("update-ref", ref, commit, cwd=entry)
            _git("bundle", "create", str(staging), "--all", cwd=entry)
            staging.rename(cached)
    return cached
