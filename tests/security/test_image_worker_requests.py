"""Finding 5 of the second security pass: Redis access must not be code execution on image workers.

The attacker can write to Redis but not to the node. They queue work by hand where a node's image
worker reads it: an rq job naming `os.system` (what `rq worker rollstream-images` used to run,
as root), a pickle that runs a command when loaded, a request naming a function, and typed
requests pointing at host files. The worker runs as the product runs it
(`rollstream images worker --burst`, a real process) and nothing of it may run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import redis as redis_sync

from rollstream.workers import image_jobs


class _RunsOnLoad:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def redis_alone():
    """A redis-server of this test alone: the image stream's keys are fixed names."""
    folder = Path(tempfile.mkdtemp(prefix="rs-imgredis-"))
    sock = folder / "redis.sock"
    server = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                               "--appendonly", "no", "--dir", str(folder)], stdout=subprocess.DEVNULL)
    client = redis_sync.Redis(unix_socket_path=str(sock))
    for _ in range(500):
        try:
            client.ping()
            break
        except (redis_sync.ConnectionError, FileNotFoundError):
            time.sleep(0.01)
    yield f"unix://{sock}", client
    server.terminate()
    server.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def _run_worker(url: str, images_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollstream", "images", "worker", "--burst", "--redis", url,
                           "--images-dir", str(images_dir)], capture_output=True, text=True, timeout=300)


def test_a_hand_queued_rq_job_naming_os_system_runs_nothing_on_the_image_worker(redis_alone, tmp_path):
    from rq import Queue

    url, client = redis_alone
    marker = tmp_path / "ran-as-the-worker"
    Queue("rollstream-images", connection=client).enqueue("os.system", f"id > {marker}")
    worker = _run_worker(url, tmp_path / "images")
    assert worker.returncode == 0, worker.stderr
    assert not marker.exists()


def test_pickles_and_function_names_added_to_the_image_stream_are_refused_not_run(redis_alone, tmp_path):
    url, client = redis_alone
    marker = tmp_path / "ran-as-the-worker"
    hostile = [
        {"request": pickle.dumps(_RunsOnLoad(f"touch {marker}"))},
        {"request": json.dumps({"kind": "os.system", "command": f"touch {marker}"})},
        {"func": "os.system", "args": json.dumps([f"touch {marker}"])},
        {"request": json.dumps({"kind": "pull", "source": "x", "func_name": "os.system"})},
        {"request": b"\xff" * 10},
    ]
    ids = [client.xadd(image_jobs.STREAM, fields).decode() for fields in hostile]
    worker = _run_worker(url, tmp_path / "images")
    assert worker.returncode == 0, worker.stderr
    assert not marker.exists()
    outcomes = [image_jobs.result(url, request_id) for request_id in ids]
    assert [o["status"] for o in outcomes] == ["refused"] * len(hostile), outcomes


def test_a_queued_pull_cannot_read_host_files_or_pass_engine_options(redis_alone, tmp_path):
    url, client = redis_alone
    secret_archive = tmp_path / "host-backup.tar"
    subprocess.run(["tar", "-cf", str(secret_archive), "-C", "/etc", "hostname"], check=True)
    requests = [image_jobs.PullRequest(source=str(secret_archive), backend="bwrap"),
                image_jobs.PullRequest(source="/dev/zero", backend="bwrap"),
                image_jobs.PullRequest(source="file:///etc/shadow", backend="bwrap"),
                image_jobs.PullRequest(source="docker://--volume=/:/host alpine", backend="bwrap"),
                image_jobs.SifBuildRequest(definition="/etc/shadow", name="x")]
    ids = [image_jobs.enqueue(url, request) for request in requests]
    worker = _run_worker(url, tmp_path / "images")
    assert worker.returncode == 0, worker.stderr
    outcomes = [image_jobs.result(url, request_id) for request_id in ids]
    assert [o["status"] for o in outcomes] == ["refused"] * len(requests), outcomes
    assert not (tmp_path / "images").exists() or not any((tmp_path / "images").iterdir())


def test_a_queued_environment_build_cannot_choose_the_host_folder_its_repository_comes_from(redis_alone, tmp_path):
    url, client = redis_alone
    record = {"instance_id": "x__y-1", "repo": "x/y", "base_commit": "a" * 40, "python": "3.11",
              "repo_mirror": "/root", "problem_statement": "p", "FAIL_TO_PASS": [], "PASS_TO_PASS": []}
    request_id = image_jobs.enqueue(url, image_jobs.EnvironmentsRequest(instances=[record]))
    worker = _run_worker(url, tmp_path / "images")
    assert worker.returncode == 0, worker.stderr
    outcome = image_jobs.result(url, request_id)
    assert outcome["status"] == "refused" and "repo_mirror" in outcome["error"], outcome
