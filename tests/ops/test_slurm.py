"""The slurm/ scripts on a real single-node Slurm: the head job and a worker array start
through sbatch, 32 echo jobs complete exactly once although one array task is cancelled
with scancel mid-run (its jobs are rescued by the other task); an inference-server array
task registers itself with the balancer and unregisters when cancelled. Nothing is left
after: no job process, no Slurm or munge daemon."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import model_cache
import psutil
import pytest
import redis

from rollstream.client import Client
from rollstream.llm.balancer import list_backends
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys

from .slurm_cluster import SlurmCluster, ensure_installed, free_port

REPO = Path(__file__).resolve().parents[2]
N_JOBS = 32
# Longer than the task's shutdown grace (2 s below): work the cancelled task holds when its SIGTERM
# comes cannot all finish in time, whatever the delay of scancel.
RUN_S = 3.0


# The daemons are started by the test itself, which Slurm allows only to root.
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="starting slurmctld/slurmd/munged needs root")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why_not = ensure_installed()
    if why_not:  # scripts/install puts them there; missing means a broken environment
        pytest.fail(f"Slurm is not usable here: {why_not}")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
        daemons = cluster.daemon_pids()
    assert not [pid for pid in daemons if psutil.pid_exists(pid)], "a Slurm or munge daemon outlived the test"


def _cancel_all(slurm: SlurmCluster, head_file: Path) -> None:
    """Cancel every job of the test and wait until none of its processes is left."""
    slurm.scancel("--user", "root")
    _wait("every job to leave the queue", lambda: not slurm.squeue(), 60)
    _wait("every process the test started to end", lambda: not _our_processes(head_file), 30,
          explain=lambda: str(_our_processes(head_file)))


def _wait(what: str, predicate, timeout_s: float, interval_s: float = 0.2, explain=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what}\n{explain()}")


def _read_head_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def _our_processes(head_file: Path) -> list[psutil.Process]:
    """Processes started for this test (they inherit ROLLSTREAM_HEAD_FILE through sbatch)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("ROLLSTREAM_HEAD_FILE") == str(head_file):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _backend_urls(redis_url: str) -> list[str]:
    async def go() -> list[str]:
        r = async_redis(redis_url)
        try:
            return [b.url.rstrip("/") for b in await list_backends(r, "rs")]
        finally:
            await r.aclose()

    return asyncio.run(go())


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(folder.glob("*.log")))


SMALL = ["--cpus-per-task=1", "--mem=200M", "--time=10"]


def _head_env(tmp_path: Path) -> dict[str, str]:
    return {
        "ROLLSTREAM_HEAD_FILE": str(tmp_path / "head.env"),
        "ROLLSTREAM_DATA_DIR": str(tmp_path / "data"),
        "ROLLSTREAM_HEAD_BIND": "127.0.0.1",
        "ROLLSTREAM_REDIS_PORT": str(free_port()),
        "ROLLSTREAM_API_PORT": str(free_port()),
        "ROLLSTREAM_CMD": f"{sys.executable} -m rollstream",
        "PYTHONPATH": str(REPO),
    }


def _start_head(slurm: SlurmCluster, env: dict[str, str], logs: Path) -> dict[str, str]:
    head_file = Path(env["ROLLSTREAM_HEAD_FILE"])
    slurm.sbatch(*SMALL, f"--output={logs}/head-%j.log", "slurm/head.sbatch", cwd=REPO, env=env)
    _wait("the head file", head_file.exists, 60, explain=lambda: _logs(logs) + slurm.logs())
    head = _read_head_file(head_file)
    assert head["REDIS_URL"].startswith("redis://:") and "@127.0.0.1:" in head["REDIS_URL"]
    assert head_file.stat().st_mode & 0o077 == 0, "the head file holds the password: mode 600"
    return head


def test_cancelled_array_task_jobs_are_rescued_and_all_complete_once(slurm, tmp_path):
    head_file = tmp_path / "head.env"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {
        **_head_env(tmp_path),
        # One process per stage; init queues up to 8 jobs past a task's 8 run slots, so the cancelled
        # task holds jobs at work and queued (jobs shorter than the grace, 0.25 s as this test had,
        # were all done by the time the SIGTERM came, once init stopped queueing without bound).
        "ROLLSTREAM_INIT_PROCS": "1", "ROLLSTREAM_RUN_PROCS": "1", "ROLLSTREAM_EVAL_PROCS": "1",
        "ROLLSTREAM_RUN_CONCURRENCY": "8", "ROLLSTREAM_INIT_RUN_AHEAD": "8",
        # Short liveness timings so the dead task's jobs are rescued within seconds.
        "ROLLSTREAM_WORKER_TTL_S": "3", "ROLLSTREAM_HEARTBEAT_INTERVAL_S": "0.5",
        "ROLLSTREAM_VISIBILITY_TIMEOUT_S": "5", "ROLLSTREAM_READ_BLOCK_MS": "200",
        "ROLLSTREAM_SHUTDOWN_GRACE_S": "2", "ROLLSTREAM_MAX_DELIVERIES": "5",
    }
    try:
        head = _start_head(slurm, env, logs)
        array_job = slurm.sbatch(*SMALL, "--array=0-1", f"--output={logs}/workers-%A_%a.log",
                                 "slurm/workers.sbatch", cwd=REPO, env=env)
        r = redis.Redis.from_url(head["REDIS_URL"])
        keys = Keys("rs")
        nodes = _wait("both array tasks' nodes to heart-beat", lambda: len(r.zrange(keys.nodes, 0, -1)) == 2 and
                      sorted(n.decode() for n in r.zrange(keys.nodes, 0, -1)), 90,
                      explain=lambda: _logs(logs))
        victim = next(n for n in nodes if n.endswith(f"{array_job}_1"))

        with Client(head["REDIS_URL"], submitter="slurm-test") as client:
            # 32 jobs over 8 run slots a task (and 8 queued ahead of each) keep both tasks busy.
            ids = client.submit_many([{"task": "echo", "instance": {"prompt": f"p{i}", "run_s": RUN_S}}
                                      for i in range(N_JOBS)])
            def held_by_victim() -> list[str]:  # the jobs task 1 holds in its run stage, queued or at work
                pipe = r.pipeline(transaction=False)
                for j in ids:
                    pipe.hmget(keys.job(j), "stage", "node")
                return [j for j, state in zip(ids, pipe.execute()) if state == [b"run", victim.encode()]]

            # Cancel task 1 while it holds work: results are flowing and its run stage holds jobs
            # (read from the jobs' states: a busy machine may let the run stream empty between polls).
            held = _wait("results to flow and task 1 to hold jobs",
                         lambda: r.xlen(keys.results("slurm-test")) >= 8 and held_by_victim(),
                         120, interval_s=0.05, explain=lambda: _logs(logs))
            slurm.scancel(f"{array_job}_1")
            _wait("task 1 to leave the queue", lambda: all(j != f"{array_job}_1" for j, _ in slurm.squeue()), 30)

            results = client.collect(N_JOBS, timeout_s=120)
            extra = list(client.results(timeout_s=2.0))

        assert not extra, f"{len(extra)} results arrived twice"
        assert sorted(res.job_id for res in results) == sorted(ids), "every job completes exactly once"
        assert all(res.ok for res in results), [res.error for res in results if not res.ok][:3]
        # scancel's SIGTERM drains the task: what it cannot finish within its grace goes back to
        # init and is done by the other task (a hand-back, not a failed attempt; a task killed
        # outright has its jobs rescued instead, attempts > 1).
        moved = [j for j in held if r.hget(keys.job(j), "node") != victim.encode()]
        assert held and (moved or any(res.attempts > 1 for res in results)), \
            "the cancelled task's jobs were finished by the other task"
        assert (f"{array_job}_0", "RUNNING") in slurm.squeue(), "the other array task keeps serving"
    finally:
        _cancel_all(slurm, head_file)
    assert not head_file.exists(), "the head job removes its head file when it stops"


def test_inference_array_task_registers_with_the_balancer_and_leaves_on_cancel(slurm, tmp_path):
    model = model_cache.load("tiny_model_dir")  # built before the tests (tests/model_cache.py), not in this one
    head_file = tmp_path / "head.env"
    logs = tmp_path / "logs"
    logs.mkdir()
    port = free_port()
    env = {**_head_env(tmp_path), "ROLLSTREAM_INFERENCE": "builtin", "ROLLSTREAM_VLLM_MODEL": str(model),
           "ROLLSTREAM_VLLM_HOST": "127.0.0.1", "ROLLSTREAM_VLLM_PORT": str(port)}
    url = f"http://127.0.0.1:{port}"
    try:
        head = _start_head(slurm, env, logs)
        job = slurm.sbatch(*SMALL, "--gpus-per-task=0", "--array=0", f"--output={logs}/vllm-%A_%a.log",
                           "slurm/vllm.sbatch", cwd=REPO, env=env)
        registered = lambda: url in _backend_urls(head["REDIS_URL"])  # noqa: E731
        _wait("the server to register with the balancer", registered, 120, interval_s=0.5,
              explain=lambda: _logs(logs))
        slurm.scancel(f"{job}_0")
        _wait("the server to unregister when cancelled", lambda: not registered(), 30, explain=lambda: _logs(logs))
    finally:
        _cancel_all(slurm, head_file)
