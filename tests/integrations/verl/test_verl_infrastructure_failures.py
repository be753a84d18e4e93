"""verl cannot drop one sample of a batch, so a job the service failed (here: its run stage
fails on every delivery) is submitted anew, ``infrastructure_resubmits`` times, and then
fails the step with the reason; a job whose environment is broken (failure "task") fails the
step at once. Neither becomes a sample scored 0. Real worker processes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("verl.experimental.agent_loop", reason="verl is an optional extra: pip install rollstream[verl]")

from test_agent_loop import SAMPLING, AgentLoopWorker, _instantiate_loop, _loop_yaml, _row_kwargs, _verl_config  # noqa: E402  (the verl fixtures' helpers, same folder)

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.integrations.verl import RolloutFailed  # noqa: E402
from rollstream.integrations.verl_results import (
    close_routers,  # noqa: E402
    shared_router,  # noqa: E402
)
from rollstream.pipeline.keys import Keys  # noqa: E402

HARBOR_TASK = Path(__file__).resolve().parents[2] / "tasks" / "harbor_tasks" / "hello-file"


async def test_a_job_the_service_fails_is_resubmitted_then_fails_the_step_never_scored_zero(
        settings, worker_pool, arith_model_dir, tmp_path):
    config = _verl_config(arith_model_dir, _loop_yaml(tmp_path, settings))
    worker = AgentLoopWorker(config, llm_client=None)
    row = _row_kwargs({"a": 2, "op": "+", "b": 3}, 0, uid="infra")
    row["extra_info"] = {"index": 0, "rollstream": {"task": "echo", "instance": {"prompt": "x", "fail_in": "run"}}}
    worker_pool().start_all(concurrency=4)
    try:
        with pytest.raises(RolloutFailed, match="failed by the service 2 times"):
            await _instantiate_loop(worker, config, infrastructure_resubmits=1).run(dict(SAMPLING), **row)
    finally:
        await close_routers()
    async with AsyncClient(settings=settings) as client:
        # the job and its one resubmission, each dead-lettered after max_deliveries attempts
        assert await client.r.xlen(Keys(settings.namespace).dead) == 2


async def test_a_job_whose_environment_is_broken_stops_the_step_at_once_never_resubmitted_nor_scored(
        settings, worker_pool, arith_model_dir, tmp_path, monkeypatch):
    """Failure kind "task" (here a Harbor folder whose Dockerfile does not build, with the real
    container engine): neither a sample scored 0 nor a job worth running again."""
    from rollstream.sandboxes.backends.docker import DockerBackend

    # scripts/test sets podman up: an engine that does not answer is a broken setup, not a skip.
    assert DockerBackend().available(), "no container engine answers (podman's socket: scripts/install-podman)"
    folder = Path(shutil.copytree(HARBOR_TASK, tmp_path / "broken-build"))
    (folder / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nRUN false\n")
    monkeypatch.setenv("ROLLSTREAM_HARBOR_TASK_ROOTS", json.dumps([str(tmp_path)]))
    config = _verl_config(arith_model_dir, _loop_yaml(tmp_path, settings))
    worker = AgentLoopWorker(config, llm_client=None)
    row = _row_kwargs({"a": 2, "op": "+", "b": 3}, 0, uid="broken-env")
    row["extra_info"] = {"index": 0, "rollstream": {"task": "harbor", "instance": {"path": str(folder)}}}
    pool = worker_pool()
    pool.env["ROLLSTREAM_HARBOR_TASK_ROOTS"] = json.dumps([str(tmp_path)])
    pool.start_all(concurrency=2)
    router = await shared_router(settings)
    seen = []
    router.observers.append(seen.append)
    try:
        with pytest.raises(RolloutFailed, match="environment is broken") as failed:
            await _instantiate_loop(worker, config, infrastructure_resubmits=2).run(dict(SAMPLING), **row)
    finally:
        await close_routers()
    assert "did not build" in str(failed.value) and "RUN false" in str(failed.value)
    assert [(r.failure, r.attempts) for r in seen] == [("task", 1)]  # one job, one attempt: no resubmission
