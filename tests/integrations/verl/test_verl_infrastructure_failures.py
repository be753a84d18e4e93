"""verl cannot drop one sample of a batch, so a job the service failed (here: its run stage
fails on every delivery) is submitted anew, ``infrastructure_resubmits`` times, and then
fails the step with the reason; it never becomes a sample scored 0. Real worker processes."""

from __future__ import annotations

import pytest

pytest.importorskip("verl.experimental.agent_loop", reason="verl is an optional extra: pip install rollstream[verl]")

from test_agent_loop import (  # noqa: E402  (the verl fixtures' helpers, same folder)
    SAMPLING, AgentLoopWorker, _instantiate_loop, _loop_yaml, _row_kwargs, _verl_config)

from rollstream.client import AsyncClient  # noqa: E402
from rollstream.integrations.verl import RolloutFailed  # noqa: E402
from rollstream.integrations.verl_results import close_routers  # noqa: E402
from rollstream.pipeline.keys import Keys  # noqa: E402


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
