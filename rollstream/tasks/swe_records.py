"""SWE-style records from the wild, made canonical for the ``swe`` task.

SWE-bench, SWE-Gym, SWE-smith and R2E-Gym name the same things differently (``repo`` /
``repo_name``, ``base_commit`` / ``commit_hash``, ``image_name`` / ``docker_image``) and
store test lists as JSON strings; a repository may be ``owner/name``, a URL or a local
path. ``normalize`` returns one dict in SWE-bench's field names, or raises InvalidJob
naming the field that cannot be understood.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rollstream.errors import InvalidJob

# canonical field <- the names other datasets use for it, first match wins
ALIASES: dict[str, tuple[str, ...]] = {
    "repo": ("repo", "repo_name", "repository"),
    "base_commit": ("base_commit", "commit_hash", "commit"),
    "image": ("image", "image_name", "docker_image", "environment_image"),
    "problem_statement": ("problem_statement", "issue", "prompt"),
    "FAIL_TO_PASS": ("FAIL_TO_PASS", "fail_to_pass", "f2p"),
    "PASS_TO_PASS": ("PASS_TO_PASS", "pass_to_pass", "p2p"),
}
LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
_OWNER_NAME = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
_URL = re.compile(r"^(?:https?://|ssh://|git://|git@)[^/:]+[/:](?P<path>.+?)(?:\.git)?/?$")


@dataclass(frozen=True)
class RepoRef:
    """Where a record's repository comes from: a mirror name, or a local git folder."""

    name: str  # owner/name; local paths get "local/<folder name>"
    path: Path | None = None  # a local clone or bundle, used as the mirror entry itself

    @property
    def short(self) -> str:
        """The folder name of the checkout inside the sandbox."""
        return self.name.split("/")[-1]


def repo_ref(repo: object) -> RepoRef:
    """``owner/name``, ``https://github.com/owner/name(.git)``, ``git@host:owner/name.git``,
    ``file:///path`` or an absolute path to a clone or bundle."""
    if not isinstance(repo, str) or not repo.strip():
        raise InvalidJob(f"swe: repo must be 'owner/name', a git URL or a local path, got {repo!r}")
    repo = repo.strip()
    if repo.startswith("file://") or repo.startswith("/"):
        path = Path(repo.removeprefix("file://"))
        if not path.exists():
            raise InvalidJob(f"swe: repo {repo!r} is a local path that does not exist")
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.name.removesuffix(".git").removesuffix(".bundle")) or "repo"
        return RepoRef(f"local/{name}", path)
    match = _URL.match(repo)
    if match:
        parts = [p for p in match.group("path").split("/") if p]
        if len(parts) < 2:
            raise InvalidJob(f"swe: repo URL {repo!r} names no owner/name")
        repo = "/".join(parts[-2:])
    if not _OWNER_NAME.match(repo) or ".." in repo.split("/"):
        raise InvalidJob(f"swe: repo must be 'owner/name', a git URL or a local path, got {repo!r}")
    return RepoRef(repo)


def test_list(value: object, field: str) -> list[str]:
    """A list of test ids; JSON strings (SWE-bench's storage) are decoded."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value
        try:
            value = json.loads(text) if text.strip() else []
        except json.JSONDecodeError:
            raise InvalidJob(f"swe: {field} is a string but not a JSON list of test ids: {text[:80]!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidJob(f"swe: {field} must be a list of test ids such as 'tests/test_x.py::test_y'")
    return value


def normalize(record: dict) -> dict:
    """The record in SWE-bench field names, lists decoded, ``repo`` as ``owner/name``.

    A local-path repository is kept as ``repo_path`` (its mirror entry). Unknown fields
    pass through untouched."""
    if not isinstance(record, dict):
        raise InvalidJob("swe: an instance must be a JSON object (a SWE-bench-style record)")
    out = dict(record)
    for canonical, names in ALIASES.items():
        for name in names:
            if name in record and record[name] not in (None, ""):
                out[canonical] = record[name]
                break
    if "repo" not in out:
        raise InvalidJob("swe: the record names no repository (repo, repo_name or repository)")
    ref = repo_ref(out["repo"])
    out["repo"] = ref.name
    if ref.path is not None:
        out["repo_path"] = str(ref.path)
    for field in LIST_FIELDS:
        out[field] = test_list(out.get(field), field)
    if out.get("test_patch") is None:
        out["test_patch"] = ""  # SWE-smith and R2E-Gym: the tests are already in the repository
    if "instance_id" not in out:
        raise InvalidJob("swe: the record has no instance_id")
    if isinstance(out.get("image"), str) and out["image"].startswith(("./", "../")):
        raise InvalidJob(f"swe: image {out['image']!r} looks like a relative path; give an absolute path or an "
                         "image reference such as 'docker.io/swebench/sweb.eval.x86_64.owner_1776_name-1:latest'")
    return out
