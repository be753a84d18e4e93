"""Issue 32, finding 4: a local user made root run any command. The sandbox root's owner was never
checked: sandboxes were made below a folder another user owns, and the default root
(/tmp/rollstream-sb-0) is a name any user may create first; in a root such a user controls, a
planted sandbox folder's plan.json had the reaper run its `cleanup_argv` as root, and a planted
confinement.json had root kill any cgroup and unmount any mount point. Now the root and every
folder above it must be changeable by root and the workers' uid alone, or nothing starts and
nothing is torn down; and the reaper acts only on folders and records its own uid wrote.

The attacker here is a real second user (uid 1000, through setpriv), creating what it may create
in the world-writable sticky /tmp and /var/tmp."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
from sandboxes.conftest import needs_bwrap, root_dir  # noqa: F401  (fixture)

from rollstream.config import Settings
from rollstream.sandboxes import SandboxSpec, create_sandbox
from rollstream.sandboxes.reaper import Reaper, teardown
from rollstream.sandboxes.roots import UnsafeSandboxRoot, check_root, ensure_root
from rollstream.sandboxes.runtime import confine
from rollstream.sandboxes.supervisor_spawn import start_fork_server
from rollstream.workers.process import serve_stage

ATTACKER = 1000
pytestmark = [
    needs_bwrap,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to act "
                       "as a second user"),
]


def as_attacker(script: str) -> None:
    """Run a shell script as uid 1000 (no groups), the way another local user would."""
    subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", "--",
                    "sh", "-euc", script], check=True, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture
def attacker_folder():
    """A folder uid 1000 made in /var/tmp, as any local user can."""
    path = f"/var/tmp/rs-attacker-{uuid.uuid4().hex[:8]}"
    as_attacker(f"mkdir -m 0755 {path}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def squatted_root():
    """The node's predictable sandbox root, created first by uid 1000 on a fresh /tmp."""
    path = f"/tmp/rollstream-sb-{uuid.uuid4().hex[:8]}"
    as_attacker(f"mkdir -m 0777 {path}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def proof_folder():
    """Where the attacker's command would leave its proof: a folder only root may write."""
    path = f"/var/tmp/rs-proof-{uuid.uuid4().hex[:8]}"
    os.mkdir(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plant_sandbox(root: str, proof: str, **record) -> None:
    """As uid 1000: a sandbox folder whose supervisor is long dead, with a plan whose
    cleanup_argv writes `proof` (as whoever runs it) and, with `record`, a confinement.json."""
    plan = {"sandbox_id": "evil", "owner": "x", "backend": "docker", "created_at": 1.0,
            "cleanup_argv": ["/bin/sh", "-c", f"id > {proof}"], "host_env": {"PATH": "/usr/bin:/bin"}}
    as_attacker(f"mkdir -m 0777 {root}/evil && cat > {root}/evil/plan.json <<'EOF'\n{json.dumps(plan)}\nEOF")
    if record:
        as_attacker(f"cat > {root}/evil/confinement.json <<'EOF'\n{json.dumps(record)}\nEOF")


def reap_all(root: str) -> Exception | None:
    """What Reaper(root).reap of every sandbox raised, if anything."""
    try:
        Reaper(root).reap(lambda _sandbox, _owner: False)
    except Exception as error:  # what the attacker's side cares about is asserted first
        return error
    return None


async def test_a_root_below_another_users_folder_is_refused(attacker_folder):
    root = os.path.join(attacker_folder, "rs")
    with pytest.raises(UnsafeSandboxRoot, match=f"belongs to uid {ATTACKER}"):
        await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="victim", root_dir=root)
    assert os.listdir(attacker_folder) == []  # nothing made there for that user to rename or replace
    with pytest.raises(UnsafeSandboxRoot):
        await start_fork_server(root)


async def test_a_predictable_root_created_first_by_another_user_is_refused(squatted_root, proof_folder):
    with pytest.raises(UnsafeSandboxRoot, match="ROLLSTREAM_SANDBOX_ROOT"):
        await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="victim", root_dir=squatted_root)
    with pytest.raises(UnsafeSandboxRoot):
        await start_fork_server(squatted_root)
    assert os.listdir(squatted_root) == []
    # Handed to root (chown) but still world-writable: other users may still plant folders.
    os.chown(squatted_root, 0, 0)
    with pytest.raises(UnsafeSandboxRoot, match="writable by other users"):
        check_root(squatted_root)


@pytest.mark.parametrize("stage", ["init", "eval"])
async def test_a_worker_refuses_to_start_on_a_root_another_user_made(squatted_root, stage, tmp_path):
    """Before it reaches Redis (none listens at this address): the check is the first thing it does."""
    settings = Settings(redis_url="redis://127.0.0.1:9/0", sandbox_root=squatted_root, data_dir=tmp_path)
    with pytest.raises(UnsafeSandboxRoot, match=f"belongs to uid {ATTACKER}"):
        await serve_stage(stage, settings, 1)


def test_a_root_squatted_as_a_symlink_is_refused(attacker_folder):
    link = f"/tmp/rollstream-sb-{uuid.uuid4().hex[:8]}"
    as_attacker(f"ln -s {attacker_folder} {link}")
    try:
        with pytest.raises(UnsafeSandboxRoot, match=f"uid {ATTACKER}"):
            ensure_root(os.path.join(link, "ns"))
        assert os.listdir(attacker_folder) == []
        # A link of root's own that leads into that user's folder: nothing is made there either.
        os.unlink(link)
        os.symlink(attacker_folder, link)
        with pytest.raises(UnsafeSandboxRoot, match=f"uid {ATTACKER}"):
            ensure_root(os.path.join(link, "ns"))
        assert os.listdir(attacker_folder) == []
    finally:
        os.unlink(link)


def test_a_planted_plan_is_never_run_by_the_reaper(squatted_root, proof_folder):
    proof = os.path.join(proof_folder, "proof")
    plant_sandbox(squatted_root, proof)
    refusal = reap_all(squatted_root)
    assert not os.path.exists(proof), f"the reaper ran the planted cleanup_argv: {Path(proof).read_text()}"
    assert isinstance(refusal, UnsafeSandboxRoot), refusal
    # teardown, the fallback of destroy_sandbox, refuses that folder as well.
    teardown(os.path.join(squatted_root, "evil"))
    assert not os.path.exists(proof) and os.path.exists(os.path.join(squatted_root, "evil", "plan.json"))


def test_a_planted_folder_in_a_root_of_ours_is_left_alone(proof_folder):
    """A root of ours, once world-writable (an operator's chmod), where uid 1000 planted a sandbox."""
    root = ensure_root(f"/tmp/rs-ours-{uuid.uuid4().hex[:8]}")
    try:
        os.chmod(root, 0o1777)
        proof = os.path.join(proof_folder, "proof")
        plant_sandbox(root, proof)
        os.chmod(root, 0o711)  # mended: the root passes, the planted folder stays uid 1000's
        assert Reaper(root).reap(lambda _sandbox, _owner: False) == []
        teardown(os.path.join(root, "evil"))
        assert not os.path.exists(proof)
    finally:
        shutil.rmtree(root)


@pytest.fixture
def foreign_cgroup():
    """A cgroup that is not a sandbox's, holding a live process."""
    found, reason = confine.hierarchies()
    assert found, f"this test needs a cgroup hierarchy of ours: {reason}"
    path = os.path.join(os.path.dirname(found[0].base), f"rs-foreign-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    process = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(path, "cgroup.procs"), "w") as handle:
        handle.write(str(process.pid))
    yield path, process
    process.kill()
    process.wait()
    if os.path.isdir(path):
        os.rmdir(path)


@pytest.fixture
def foreign_mount():
    """A tmpfs mounted on the host that is not a sandbox's."""
    point = f"/var/tmp/rs-mount-{uuid.uuid4().hex[:8]}"
    os.mkdir(point)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "rs-foreign", point], check=True)
    yield point
    if _mounted(point):
        ctypes.CDLL(None).umount2(point.encode(), 2)
    os.rmdir(point)


def _mounted(point: str) -> bool:
    with open("/proc/self/mountinfo") as handle:
        return any(line.split()[4] == point for line in handle)


def test_a_planted_confinement_record_never_kills_a_foreign_cgroup_nor_unmounts_a_mount(
        squatted_root, proof_folder, foreign_cgroup, foreign_mount):
    cgroup, process = foreign_cgroup
    record = {"cgroups": [cgroup], "versions": [1], "tmpfs": foreign_mount, "limits": {}, "fallback": ""}
    plant_sandbox(squatted_root, os.path.join(proof_folder, "proof"), **record)
    refusal = reap_all(squatted_root)
    teardown(os.path.join(squatted_root, "evil"))
    assert process.poll() is None and os.path.isdir(cgroup), "root killed the cgroup the planted record named"
    assert _mounted(foreign_mount), "root unmounted the mount point the planted record named"
    assert isinstance(refusal, UnsafeSandboxRoot), refusal


def test_a_confinement_record_naming_what_is_not_its_sandboxs_is_refused(foreign_cgroup, foreign_mount):
    """Even a record of our own uid, in a folder of ours, releases only its own sandbox's
    cgroups (ID.PID in a rollstream folder) and mount (its data folder)."""
    cgroup, process = foreign_cgroup
    root = ensure_root(f"/tmp/rs-ours-{uuid.uuid4().hex[:8]}")
    try:
        folder = os.path.join(root, "sb1")
        os.mkdir(folder, 0o700)
        with open(os.path.join(folder, "confinement.json"), "w") as handle:
            json.dump({"cgroups": [cgroup], "versions": [1], "tmpfs": foreign_mount, "limits": {}}, handle)
        with pytest.raises(confine.ForeignRecord, match="not one of this sandbox's"):
            confine.Confinement.load(folder)
        teardown(folder)
        assert process.poll() is None and os.path.isdir(cgroup) and _mounted(foreign_mount)
    finally:
        shutil.rmtree(root)


async def test_a_sandbox_made_under_a_permissive_umask_is_still_reaped(root_dir):
    """The reaper trusts only files no other user may write: rollstream's own plan and record are
    made so whatever the umask of the workers (0 here), or a crashed sandbox would never go."""
    old = os.umask(0)
    try:
        handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="umask0", root_dir=root_dir)
    finally:
        os.umask(old)
    supervisor = psutil.Process(handle.supervisor_pid)
    os.kill(handle.supervisor_pid, signal.SIGKILL)
    supervisor.wait(timeout=10)
    assert Reaper(root_dir).reap(lambda _sandbox, _owner: True) == ["umask0"]
    assert not os.path.exists(handle.dir)
