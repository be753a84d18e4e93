"""Image preparation as queued requests: a rootfs tarball unpacked by a node's image worker, then used by bwrap."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import time

import pytest

from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox, images
from rollstream.workers import image_jobs

from .conftest import needs_bwrap


def _minimal_rootfs_tarball(folder: str) -> str:
    """bash, cat and stty with their shared libraries: enough for a sandbox shell."""
    rootfs = os.path.join(folder, "rootfs")
    for binary in ("bash", "cat", "stty"):
        path = shutil.which(binary)
        assert path is not None
        files = [path] + [
            part for line in subprocess.run(["ldd", path], capture_output=True, text=True).stdout.splitlines()
            for part in line.split() if part.startswith("/")
        ]
        for source in files:
            real = os.path.realpath(source)
            for target in {source, real}:
                inside = target.lstrip("/")
                if target.startswith("/bin/"):
                    inside = inside.replace("bin/", "usr/bin/", 1)
                destination = os.path.join(rootfs, inside)
                os.makedirs(os.path.dirname(destination), exist_ok=True)
                if not os.path.exists(destination):
                    shutil.copy2(real, destination)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}") and not os.path.exists(os.path.join(rootfs, link)):
            os.symlink(os.readlink(f"/{link}"), os.path.join(rootfs, link))
    os.makedirs(os.path.join(rootfs, "etc"), exist_ok=True)
    tarball = os.path.join(folder, "mini.tar.gz")
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(rootfs, arcname=".")
    return tarball


@pytest.fixture
def redis_socket():
    folder = tempfile.mkdtemp(prefix="rsredis-", dir="/tmp")
    sock = os.path.join(folder, "redis.sock")
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no", "--dir", folder],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        if os.path.exists(sock):
            break
        time.sleep(0.02)
    yield f"unix://{sock}"
    server.terminate()
    server.wait()
    shutil.rmtree(folder, ignore_errors=True)


@needs_bwrap
async def test_rootfs_tarball_unpacked_by_an_rq_job_runs_a_sandbox(tmp_path, redis_socket, root_dir):
    tarball = _minimal_rootfs_tarball(str(tmp_path))
    images_dir = str(tmp_path / "images")
    request_id = image_jobs.enqueue(redis_socket, image_jobs.PullRequest(source=tarball, backend="bwrap"))
    worker = image_jobs.ImageWorker(redis_socket, images_dir=images_dir, source_dirs=[str(tmp_path)])
    assert worker.work(burst=True) == 1
    outcome = image_jobs.result(redis_socket, request_id)
    assert outcome is not None and outcome["status"] == "finished", outcome
    rootfs = outcome["result"]
    assert [(i.name, i.kind) for i in images.list_images(images_dir)] == [("mini", "rootfs")]

    handle = await create_sandbox(SandboxSpec(backend="bwrap", image=rootfs), sandbox_id="img", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            result = await sb.bash("echo hi > f.txt; cat f.txt; echo /usr/bin/*")
            lines = result.output.splitlines()
            assert lines[0] == "hi"
            # Only the image's programs, not the host's.
            assert sorted(os.path.basename(p) for p in lines[1].split()) == ["bash", "cat", "stty"]
    finally:
        await destroy_sandbox(handle)
