"""Every segment of a multi-chain job reaches verl: under verl's v1 trainer (its worker passes
``session_id`` and takes several outputs per rollout) the rollstream loop returns one output per
segment, the top-level one last, each exact and with the job's reward; verl's own v1 advantage
code then gives every segment its job's GRPO advantage, computed over jobs, never segments. The
legacy worker, which takes one output, gets the top-level one and the count of the others."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch

pytest.importorskip("verl.experimental.agent_loop", reason="verl is an optional extra: pip install rollstream[verl]")

from test_agent_loop import SAMPLING, AgentLoopWorker, _instantiate_loop, _loop_yaml, _row_kwargs, _verl_config  # noqa: E402, I001  (same folder)
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.core_algos import AdvantageEstimator  # noqa: E402
from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories  # noqa: E402

from rollstream.integrations.verl_results import close_routers, shared_router  # noqa: E402
from rollstream.messages import Result  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

G = 2


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)


async def test_each_segment_is_an_output_of_its_own_and_verl_v1_gives_it_its_jobs_advantage(
        settings, compacting_pool, compacting_agent, arith_model_dir, arith_server, tmp_path):
    config = _verl_config(arith_model_dir, _loop_yaml(tmp_path, settings))
    worker = AgentLoopWorker(config, llm_client=None)
    router = await shared_router(settings)
    seen: dict[str, Result] = {}
    router.observers.append(lambda r: seen.__setitem__(r.job_id, r))
    await add_backend(router.client.r, arith_server, settings.namespace)
    compacting_pool.start_all(concurrency=4)
    uid = uuid.uuid4().hex
    instance = arith.make_instances(1, seed=31)[0]
    row = _row_kwargs(instance, 0, uid)
    row["extra_info"] = {"index": 0, "rollstream": {"task": "arith", "instance": instance, "agent": compacting_agent}}
    try:
        # as verl's v1 worker (AgentLoopWorkerTQ._run_prompt) runs the G sessions of one prompt
        sessions = await asyncio.gather(*[_instantiate_loop(worker, config).run(dict(SAMPLING), session_id=i, **row)
                                          for i in range(G)])
        legacy = await _instantiate_loop(worker, config).run(dict(SAMPLING), **row)
    finally:
        await close_routers()

    keys, outputs = [], []
    for session, outs in enumerate(sessions):
        assert isinstance(outs, list) and len(outs) == 2, outs  # the compacting harness made two segments
        result = seen[outs[-1].extra_fields["rollstream_job_id"]]
        assert result.ok, result.error
        segments = result.trajectory.segments
        for number, (out, seg) in enumerate(zip(outs, segments)):
            assert isinstance(out, AgentLoopOutput) and out.extra_fields["rollstream_segment"] == number
            assert out.prompt_ids == seg.prompt_ids and out.response_ids == seg.response_ids
            assert out.response_mask == seg.loss_mask
            assert out.response_logprobs == [lp if m else 0.0 for lp, m in zip(seg.logprobs, seg.loss_mask)]
            assert out.reward_score == result.reward
            keys.append(f"{uid}_{session}_{number}")  # AgentLoopWorkerTQ's key of each output
            outputs.append(out)
        assert outs[-1].response_ids == result.trajectory.response_ids  # the top-level sequence last
    # The legacy worker takes one output per sample: the top-level sequence, the others counted.
    assert isinstance(legacy, AgentLoopOutput) and legacy.extra_fields["rollstream_untrained_segments"] == 1

    # verl's v1 advantage code on these rows, as its trainer holds them (AgentLoopOutput.as_dict).
    fields = [out.as_dict() for out in outputs]
    # Rewards that differ per session (the tiny model's arith rewards are mostly all 0), so the
    # advantages are not all 0: the job's own reward plus its session number.
    scores = []
    for f, key in zip(fields, keys):
        score = f["rm_scores"].clone()  # the job's reward on its last token
        score[-1] += int(key.split("_")[1])
        scores.append(score)
    data = DataProto.from_dict(
        tensors={"response_mask": _padded([f["response_mask"] for f in fields]),
                 "token_level_rewards": _padded(scores)},
        non_tensors={"uid": np.array([uid] * len(keys), dtype=object)})
    data = compute_advantage_for_multi_trajectories(data, batch_keys=keys, adv_estimator=AdvantageEstimator.GRPO,
                                                    num_repeat=G)
    advantages = data.batch["advantages"]
    mask = data.batch["response_mask"].bool()
    per_row = [advantages[i][mask[i]].unique().tolist() for i in range(len(keys))]
    assert all(len(values) == 1 for values in per_row), per_row  # one advantage per row, on its model tokens
    job_advantage = {key.rsplit("_", 1)[0]: values[0] for key, values in zip(keys, per_row)}
    for key, values in zip(keys, per_row):
        assert values[0] == job_advantage[key.rsplit("_", 1)[0]]  # each segment has its job's advantage
    # GRPO over the G jobs of the prompt (segments are not group members): they centre on 0, and differ.
    assert sum(job_advantage.values()) == pytest.approx(0.0, abs=1e-4)
    assert len(set(job_advantage.values())) == G
    assert torch.all(advantages[~mask] == 0)
