"""Issue #32, finding 2: a SWE job made the root init worker read any host file. Its
`repo_mirror` (and a repository named by local path) chose the folder a bundle was read from,
a symlinked `<owner>__<name>.bundle` was followed, a FIFO blocked the worker, a device fed it
without end, and the mirror's lock created folders and files wherever the job said. Now every
path from a job lies beneath the operator's `swe_repo_mirrors`, and a bundle is read only as a
plain file of bounded size, opened beneath its root without following a symlink."""

from __future__ import annotations

import json
import os
import stat
import uuid

import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope, Job
from rollstream.tasks import swe_records, swe_repos
from rollstream.tasks.base import TaskContext
from rollstream.tasks.swe import SweTask, load_instances
from rollstream.workers.init import set_up
from rollstream.workers.node_sandboxes import NodeSandboxes

SECRET = b"root:$6$secret-hash-only-root-may-read:19000:0:99999:7:::\n"
COMMIT = "a" * 40


@pytest.fixture
def secret(tmp_path):
    """A host file only root may read, outside every mirror folder."""
    path = tmp_path / "host" / "shadow"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def mirrors(tmp_path, monkeypatch):
    """The operator's one allowed mirror folder, set as a node sets it (the environment)."""
    allowed = tmp_path / "mirrors"
    allowed.mkdir()
    monkeypatch.setenv("ROLLSTREAM_SWE_REPO_MIRRORS", json.dumps([str(allowed)]))
    return allowed


@needs_bwrap
async def test_a_symlinked_bundle_in_a_folder_the_job_names_never_reaches_its_sandbox(
        secret, mirrors, tmp_path, root_dir):  # noqa: F811
    attacker = tmp_path / "attacker"
    attacker.mkdir()
    (attacker / "x__y.bundle").symlink_to(secret)
    instance = {**load_instances()[0], "repo": "x/y", "base_commit": COMMIT, "repo_mirror": str(attacker)}
    env = Envelope(job=Job(task="swe", instance=instance))
    sandboxes = NodeSandboxes(root=str(root_dir))
    try:
        with pytest.raises(swe_repos.MirrorRefused, match="swe_repo_mirrors") as refused:
            await set_up(SweTask(), env, TaskContext(node="n", work_dir=tmp_path), sandboxes)
    finally:
        await sandboxes.destroy(env)
    assert isinstance(refused.value, InvalidJob)  # the job's fault: failure 'job', never retried
    assert str(secret) not in str(refused.value)


def test_a_symlinked_bundle_inside_an_allowed_mirror_is_not_followed(secret, mirrors):
    (mirrors / "x__y.bundle").symlink_to(secret)
    roots = swe_repos.MirrorRoots.from_settings()
    with pytest.raises(swe_repos.MirrorRefused, match="symlink"):
        swe_repos.read_bundle(swe_repos.bundle("x/y", COMMIT, mirrors, roots=roots), roots)


def test_a_symlinked_clone_leading_out_of_the_mirror_is_refused(mirrors, tmp_path):
    outside = tmp_path / "private-repo"
    outside.mkdir()
    (mirrors / "x__y").symlink_to(outside)
    with pytest.raises(swe_repos.MirrorRefused, match="mirror entry"):
        swe_repos.bundle("x/y", COMMIT, mirrors)


@pytest.mark.timeout(30)
def test_a_fifo_bundle_is_refused_without_blocking_the_worker(mirrors):
    os.mkfifo(mirrors / "x__y.bundle")
    roots = swe_repos.MirrorRoots.from_settings()
    with pytest.raises(swe_repos.MirrorRefused, match="not a regular file"):
        swe_repos.read_bundle(swe_repos.bundle("x/y", COMMIT, mirrors, roots=roots), roots)


@pytest.mark.timeout(30)
def test_a_device_bundle_is_refused_without_reading_it(mirrors):
    # /dev/zero's own node, made inside the mirror (root may mknod): endless bytes if read.
    os.mknod(mirrors / "x__y.bundle", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    roots = swe_repos.MirrorRoots.from_settings()
    with pytest.raises(swe_repos.MirrorRefused, match="not a regular file"):
        swe_repos.read_bundle(swe_repos.bundle("x/y", COMMIT, mirrors, roots=roots), roots)


@pytest.mark.timeout(30)
def test_a_local_repository_path_to_a_device_is_refused(mirrors):
    instance = swe_records.normalize({**load_instances()[0], "repo": "/dev/zero"})
    with pytest.raises(swe_repos.MirrorRefused, match="repository path '/dev/zero'"):
        swe_repos.bundle(instance["repo"], COMMIT, mirrors, instance["repo_path"])


def test_a_bundle_over_the_operators_size_cap_is_refused(mirrors):
    (mirrors / "x__y.bundle").write_bytes(b"#" * 4096)
    roots = swe_repos.MirrorRoots((mirrors,), bundle_max_bytes=1024)
    with pytest.raises(swe_repos.MirrorRefused, match="swe_bundle_max_bytes"):
        swe_repos.read_bundle(swe_repos.bundle("x/y", COMMIT, mirrors, roots=roots), roots)
    assert swe_repos.read_bundle(mirrors / "x__y.bundle", swe_repos.MirrorRoots((mirrors,))) == b"#" * 4096


def test_a_mirror_outside_the_allow_list_creates_no_folder_or_lock(mirrors, tmp_path):
    # A shipped repository is built into the mirror on first use: the job's folder would be made.
    target = tmp_path / f"elsewhere-{uuid.uuid4().hex}" / "deep"
    repo = f"{swe_repos.SHIPPED_OWNER}/{swe_repos.shipped_repo_names()[0]}"
    with pytest.raises(swe_repos.MirrorRefused, match="repo_mirror"):
        swe_repos.locate(repo, target)
    assert not target.parent.exists()


def test_a_symlinked_lock_in_an_allowed_mirror_truncates_nothing(mirrors, secret):
    (mirrors / ".lock").symlink_to(secret)
    repo = f"{swe_repos.SHIPPED_OWNER}/{swe_repos.shipped_repo_names()[0]}"
    with pytest.raises(swe_repos.MirrorRefused, match="lock"):
        swe_repos.locate(repo, mirrors)
    assert secret.read_bytes() == SECRET


def test_the_default_mirror_and_a_listed_one_still_serve_the_shipped_repositories(mirrors):
    inst = load_instances()[0]
    roots = swe_repos.MirrorRoots.from_settings()
    path = swe_repos.bundle(inst["repo"], inst["base_commit"], mirrors / "sub", roots=roots)
    assert swe_repos.read_bundle(path, roots).startswith(b"# v2 git bundle")
