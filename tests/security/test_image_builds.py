"""Finding 6 of the second security pass: an environment build is a job's code, run by the node.

The attacker writes the SWE record (its recipe: base image, commands, repository, commit). From
there they try to reach a service on the host's loopback while the image builds (Redis, the door
and model servers listen there), to add Containerfile instructions through a field that is not a
shell word, and to leave device nodes, setuid programs and files owned by a host user in the
rootfs cache that every bwrap sandbox (and, hard-linked, every other image) shares. The build is
real: podman, the base image scripts/install-podman makes, a rootfs exported for bubblewrap.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from rollstream.sandboxes import images
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE, EnvRecipe, build_env_image, build_network, image_exists
from rollstream.tasks import swe_env

needs_engine = pytest.mark.skipif(not DockerBackend().available(),
                                  reason="no container engine answers here (scripts/install-podman)")


class LoopbackService:
    """A TCP service on the host's 127.0.0.1, as Redis or the door would be; it records who connects."""

    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            with connection:
                self.received.append(connection.recv(100) or b"(connected)")

    def close(self) -> None:
        self.server.close()


def _git_repo(folder: Path) -> tuple[str, str]:
    folder.mkdir()
    (folder / "README").write_text("attacker's project\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@a", "GIT_COMMITTER_NAME": "a",
           "GIT_COMMITTER_EMAIL": "a@a"}
    for argv in (["git", "init", "-q", "-b", "main"], ["git", "add", "README"], ["git", "commit", "-q", "-m", "x"]):
        subprocess.run(argv, cwd=folder, check=True, env=env)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, check=True, capture_output=True,
                            text=True).stdout.strip()
    return str(folder), commit


@pytest.fixture(scope="module")
def hostile_build(tmp_path_factory):
    """One real build of an attacker's recipe (the slow part, shared): it probes the host's loopback,
    makes device nodes, a setuid shell and files owned by host uid 1000, then is exported for bwrap."""
    if not DockerBackend().available():  # scripts/test sets one up: its absence is a failure, not a skip
        pytest.fail("no container engine answers at DOCKER_HOST: run scripts/install-podman and export DOCKER_HOST")
    folder = tmp_path_factory.mktemp("hostile-build")
    service = LoopbackService()
    repo, commit = _git_repo(folder / "repo")
    probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {service.port}), 3)"
             f".sendall(b'reached from the build')\" || echo host loopback unreachable")
    recipe = EnvRecipe(python="3.11.7", repo="attacker/env", commit=commit, repo_dir="/workspace/env",
                       install="true", pre_install=[
                           probe,
                           "mknod /usr/local/mem-node c 1 1 && mknod /usr/local/disk-node b 8 0 && "
                           "mkfifo /usr/local/fifo-node",
                           "cp /bin/bash /usr/local/bin/rootshell && chmod 4755 /usr/local/bin/rootshell",
                           "mkdir -p /srv/shared && chmod 1777 /srv/shared && touch /srv/owned && "
                           "chown 1000:1000 /srv/owned /srv/shared && chmod 0666 /srv/owned",
                       ])
    images_dir = folder / "images"
    try:
        built = build_env_image(recipe, repo, ("docker", "bwrap"), str(images_dir), force=True)
        yield built, service, images_dir
    finally:
        service.close()
        subprocess.run(["docker", "rmi", "--force", recipe.tag], capture_output=True)


@needs_engine
def test_a_build_step_cannot_reach_a_service_on_the_hosts_loopback(hostile_build):
    built, service, _ = hostile_build
    assert built.built and image_exists(built.tag)  # the probe ran: the build went past it
    assert service.received == []


@needs_engine
def test_an_exported_rootfs_holds_no_device_nodes_or_fifos(hostile_build):
    built, _, _ = hostile_build
    local = Path(built.rootfs) / "usr" / "local"
    assert not any(os.path.lexists(local / name) for name in ("mem-node", "disk-node", "fifo-node"))
    kinds = (stat.S_ISCHR, stat.S_ISBLK, stat.S_ISFIFO, stat.S_ISSOCK)
    special = [str(p) for p in Path(built.rootfs).rglob("*") if any(kind(p.lstat().st_mode) for kind in kinds)]
    assert special == []


@needs_engine
def test_an_exported_rootfs_holds_no_setuid_program_and_nothing_others_may_write(hostile_build):
    built, _, _ = hostile_build
    rootfs = Path(built.rootfs)
    assert stat.S_IMODE((rootfs / "usr/local/bin/rootshell").stat().st_mode) == 0o755
    loose = [str(p) for p in rootfs.rglob("*") if not p.is_symlink()
             and p.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | 0o022)]
    assert loose == []


@needs_engine
def test_an_exported_rootfs_is_owned_by_the_node_not_by_the_image_uids_of_host_users(hostile_build):
    built, _, images_dir = hostile_build
    rootfs = Path(built.rootfs)
    assert {(p.lstat().st_uid, p.lstat().st_gid) for p in rootfs.rglob("*")} == {(os.geteuid(), os.getegid())}
    assert stat.S_IMODE(images_dir.stat().st_mode) == 0o711  # sandboxes reach a rootfs, list nothing


@pytest.mark.parametrize("field, value", [
    ("base_image", f"{DEFAULT_BASE_IMAGE}\nRUN touch /pwned"),
    ("base_image", "--network=host busybox"),
    ("python", "3.11\nRUN touch /pwned"),
    ("environment_setup_commit", "main\nRUN touch /pwned"),
    ("environment_setup_commit", "--upload-pack=touch /pwned"),
    ("environment_setup_commit", "HEAD~1"),
    ("pre_install", ["true\nRUN --network=host curl http://127.0.0.1:6379"]),
    ("install", "pip install .\nCOPY / /host"),
    ("pip_packages", ["pytest\nUSER root"]),
])
def test_recipe_fields_cannot_add_containerfile_instructions_or_options(field, value):
    record = {"instance_id": "a__b-1", "repo": "attacker/env", "base_commit": "a" * 40, "python": "3.11",
              "problem_statement": "p", "FAIL_TO_PASS": [], "PASS_TO_PASS": [], field: value}
    with pytest.raises(ValueError, match=field.replace("environment_setup_commit", "commit") + "|line break"):
        swe_env.env_recipe(record)


@pytest.mark.parametrize("repo", ["attacker/env\nRUN touch /pwned", "attacker/env/../../x", "a b/c", "x/.."])
def test_a_repository_name_that_is_not_owner_slash_name_is_refused(repo):
    with pytest.raises(ValueError, match="owner/name"):
        EnvRecipe(repo=repo, commit="a" * 40, repo_dir="/workspace/env")


@pytest.mark.parametrize("repo_dir", ["/workspace/env\nRUN touch /pwned", "/workspace/../etc", "relative", "/a b"])
def test_a_repo_dir_that_is_not_a_plain_absolute_path_is_refused(repo_dir):
    with pytest.raises(ValueError, match="repo_dir"):
        EnvRecipe(repo="attacker/env", commit="a" * 40, repo_dir=repo_dir)


def test_the_hosts_network_is_never_given_to_a_build(monkeypatch, tmp_path):
    monkeypatch.setenv("ROLLSTREAM_ENV_BUILD_NETWORK", "host")
    with pytest.raises(ValueError, match="never given to a build"):
        build_network()
    recipe = EnvRecipe(repo="attacker/env", commit="a" * 40, repo_dir="/workspace/env")
    with pytest.raises(ValueError, match="not 'host'"):
        build_env_image(recipe, str(tmp_path), network="host")


def test_an_images_folder_another_user_owns_or_may_write_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 1000, 1000)
    with pytest.raises(images.ImagesDirUnsafe, match="owned by uid 1000"):
        images.images_folder(str(theirs))
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(images.ImagesDirUnsafe, match="writable by other users"):
        images.images_folder(str(open_to_all))
    planted = tmp_path / "planted"
    planted.symlink_to(theirs)
    with pytest.raises(images.ImagesDirUnsafe, match="not a folder"):
        images.images_folder(str(planted))
