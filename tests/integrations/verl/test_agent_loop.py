"""The rollstream agent loop driven by verl's own classes (its registry, hydra instantiation
as AgentLoopWorker does it, ``run()``, AgentLoopOutput, and the worker's batch padding)
against a live rollstream: Redis, the three worker pools, bubblewrap sandboxes with bash,
the built-in server on the arith model."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl.experimental.agent_loop", reason="verl is an optional extra: pip install rollstream[verl]")

import hydra  # noqa: E402
import verl.trainer.config as verl_config_pkg  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.protocol import DataProto  # noqa: E402

from rollstream.integrations.verl import AGENT_NAME, RolloutFailed, RollstreamAgentLoop, VerlLoopConfig  # noqa: E402
from rollstream.integrations.verl_mapping import dataset_row, observation_blocks  # noqa: E402
from rollstream.integrations.verl_results import close_routers, shared_router  # noqa: E402
from rollstream.llm.balancer import add_backend  # noqa: E402
from rollstream.messages import Result  # noqa: E402
from rollstream.tasks import arith  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 512, 256
EXAMPLE_YAML = Path(__file__).resolve().parents[3] / "examples" / "verl" / "agent_loop.yaml"
# What AgentLoopWorker.generate_sequences builds for a training (not validation) batch.
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def _loop_yaml(tmp_path: Path, settings) -> Path:
    path = tmp_path / "agent_loop.yaml"
    path.write_text(
        f"- name: {AGENT_NAME}\n"
        "  _target_: rollstream.integrations.verl.RollstreamAgentLoop\n"
        f"  redis_url: {settings.redis_url}\n"
        f"  namespace: {settings.namespace}\n"
        "  task: arith\n"
        "  wait_timeout_s: 240\n"
        "  agent:\n    max_turns: 3\n    max_tokens_per_turn: 48\n")
    return path


def _verl_config(model_dir: Path, loop_yaml: Path):
    config_dir = os.path.dirname(verl_config_pkg.__file__)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=vllm",  # a mandatory label; no vLLM runs here
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_yaml}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={AGENT_NAME}",
        ])


def _row_kwargs(instance: dict, index: int, uid: str) -> dict:
    """A sample as AgentLoopWorker hands it to run(): the dataset row's non-tensor fields."""
    row = dataset_row("arith", instance, index=index)
    return {"raw_prompt": row["prompt"], "extra_info": row["extra_info"], "data_source": row["data_source"],
            "index": np.int64(index), "uid": uid, "tools_kwargs": {}, "interaction_kwargs": {}}


def _batch(rows: list[dict]) -> DataProto:
    non_tensor = {}
    for key in rows[0]:
        column = np.empty(len(rows), dtype=object)
        column[:] = [row[key] for row in rows]
        non_tensor[key] = column
    return DataProto(non_tensor_batch=non_tensor, meta_info={"global_steps": 1, "validate": False})


def _check_mask_is_on_observations(t, tokenizer) -> None:
    """Mask 0 exactly on tool observations: each 0-run of the trajectory decodes to the
    observation messages between one assistant message and the next."""
    runs, current = [], []
    for tok, m in zip(t.response_ids, t.loss_mask):
        if m == 0:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    blocks: list[list[str]] = []
    for message in t.messages:
        if message.role == "assistant":
            blocks.append([])
        elif blocks:
            blocks[-1].append(message.content)
    blocks = [b for b in blocks if b]
    assert len(runs) == len(blocks), (t.loss_mask, t.messages)
    for run_ids, contents in zip(runs, blocks):
        text = tokenizer.decode(run_ids)
        assert all(content.strip() in text for content in contents), (text, contents)


def _check_against_trajectory(out: AgentLoopOutput, result: Result, tokenizer) -> None:
    t = result.trajectory
    cut = min(len(t.response_ids), RESPONSE_LENGTH)  # verl's rollout.response_length
    assert out.prompt_ids == t.prompt_ids
    assert out.response_ids == t.response_ids[:cut]
    assert out.response_mask == t.loss_mask[:cut]
    assert out.response_logprobs == [lp if m else 0.0 for lp, m in zip(t.logprobs[:cut], t.loss_mask[:cut])]
    assert out.extra_fields["rollstream_truncated"] == (cut < len(t.response_ids))
    assert out.reward_score == result.reward
    assert out.num_turns == 1 + t.num_turns + observation_blocks(t.loss_mask)
    assert out.extra_fields["rollstream_job_id"] == result.job_id
    assert out.extra_fields["rollstream_policy_version"] == result.policy_version
    _check_mask_is_on_observations(t, tokenizer)


def _instantiate_loop(worker, config, **options) -> RollstreamAgentLoop:
    """The registered loop, instantiated exactly as AgentLoopWorker._run_agent_loop does."""
    return hydra.utils.instantiate(
        config=_agent_loop_registry[AGENT_NAME], trainer_config=DictConfigWrap(config=config),
        server_manager=None, tokenizer=worker.tokenizer, processor=worker.processor,
        hf_model_type=worker.hf_model_type, dataset_cls=worker.dataset_cls,
        data_config=DictConfigWrap(config.data), tools=ToolListWrap(worker.tools), **options)


@pytest.fixture
def settings(shared_pool, arith_model_dir):
    """Overrides conftest's per-test settings here: the settings of the module's pool of arith
    workers, shared by its tests (workers start and load the tokenizer once, not once a test)."""
    return shared_pool("arith", concurrency=8, model_dir=arith_model_dir)


async def test_verl_runs_the_registered_rollstream_loop_and_gets_token_exact_outputs(
        settings, arith_model_dir, arith_server, tmp_path):
    config = _verl_config(arith_model_dir, _loop_yaml(tmp_path, settings))
    # verl's worker, built as AgentLoopManager builds it (minus the Ray actor wrapper):
    # it loads our YAML into the registry under "rollstream".
    worker = AgentLoopWorker(config, llm_client=None)
    assert _agent_loop_registry[AGENT_NAME]["_target_"] == "rollstream.integrations.verl.RollstreamAgentLoop"

    router = await shared_router(settings)  # the loop's own router: same loop, Redis, namespace
    seen: dict[str, Result] = {}
    router.observers.append(lambda r: seen.__setitem__(r.job_id, r))
    await add_backend(router.client.r, arith_server, settings.namespace)
    try:
        # 1. run() on loops instantiated exactly as AgentLoopWorker._run_agent_loop does.
        instances = arith.make_instances(4, seed=11)
        uid = uuid.uuid4().hex
        loops = [_instantiate_loop(worker, config) for _ in range(2)]
        assert all(isinstance(loop, RollstreamAgentLoop) for loop in loops)
        outputs = await asyncio.gather(*[loop.run(dict(SAMPLING), **_row_kwargs(instances[0], 0, uid))
                                         for loop in loops])
        for out in outputs:
            assert isinstance(out, AgentLoopOutput)
            result = seen[out.extra_fields["rollstream_job_id"]]
            assert result.ok and result.group_id == f"verl-{uid}"
            _check_against_trajectory(out, result, worker.tokenizer)
            assert out.metrics.generate_sequences > 0

        # 2. verl's whole batch path: generate_sequences pads, masks and places rm_scores.
        rows = [_row_kwargs(inst, i, uid=f"u{i}") for i, inst in enumerate(instances[1:3]) for _ in range(2)]
        batch = await worker.generate_sequences(_batch(rows))
    finally:
        await close_routers()

    assert batch.batch["prompts"].shape == (4, PROMPT_LENGTH)
    assert batch.batch["responses"].shape == (4, RESPONSE_LENGTH)
    job_ids = batch.non_tensor_batch["rollstream_job_id"]
    for i, job_id in enumerate(job_ids):
        t, result = seen[job_id].trajectory, seen[job_id]
        n, p = min(len(t.response_ids), RESPONSE_LENGTH), len(t.prompt_ids)
        assert batch.batch["prompts"][i, -p:].tolist() == t.prompt_ids
        assert batch.batch["attention_mask"][i, :PROMPT_LENGTH - p].sum() == 0
        assert batch.batch["responses"][i, :n].tolist() == t.response_ids[:n]
        assert batch.batch["response_mask"][i, :n].tolist() == t.loss_mask[:n]
        assert batch.batch["response_mask"][i, n:].sum() == 0
        logprobs = batch.batch["rollout_log_probs"][i, :n].tolist()
        assert logprobs == pytest.approx([lp if m else 0.0 for lp, m in zip(t.logprobs[:n], t.loss_mask[:n])],
                                         abs=1e-6)
        scores = batch.batch["rm_scores"][i]
        assert scores[n - 1].item() == result.reward and scores.sum().item() == result.reward
        assert batch.non_tensor_batch["__num_turns__"][i] == 1 + t.num_turns + observation_blocks(t.loss_mask)
        _check_mask_is_on_observations(t, worker.tokenizer)
    # The samples of one verl prompt (one uid) went to rollstream as one group.
    assert seen[job_ids[0]].group_id == seen[job_ids[1]].group_id == "verl-u0"
    # The warmed-up model used the bash tool: some observations were masked.
    assert any(0 in seen[j].trajectory.loss_mask for j in seen)


def test_example_config_names_the_registered_loop():
    from omegaconf import OmegaConf

    entries = OmegaConf.load(EXAMPLE_YAML)
    entry = next(e for e in entries if e.name == AGENT_NAME)
    assert entry._target_ == f"{RollstreamAgentLoop.__module__}.{RollstreamAgentLoop.__qualname__}"
    assert set(entry.keys()) - {"name", "_target_"} <= set(VerlLoopConfig.model_fields)


async def test_failed_rollstream_job_raises_or_becomes_an_empty_zero_reward_sample(
        settings, arith_model_dir, arith_server, tmp_path):
    config = _verl_config(arith_model_dir, _loop_yaml(tmp_path, settings))
    worker = AgentLoopWorker(config, llm_client=None)

    def make_loop(**options) -> RollstreamAgentLoop:
        return _instantiate_loop(worker, config, **options)

    # A sandbox that cannot start: init fails on every delivery and the job fails.
    row = _row_kwargs({"a": 2, "op": "+", "b": 3}, 0, uid="bad")
    spec = {"task": "arith", "instance": {"a": 2, "op": "+", "b": 3},
            "sandbox": {"setup_commands": ["exit 3"], "setup_timeout_s": 5}}
    row["extra_info"] = {"index": 0, "rollstream": spec}  # a plain dict works as well as JSON
    router = await shared_router(settings)
    await add_backend(router.client.r, arith_server, settings.namespace)
    try:
        with pytest.raises(RolloutFailed, match="failed"):
            await make_loop().run(dict(SAMPLING), **row)
        out = await make_loop(on_failure="zero_reward").run(dict(SAMPLING), **row)
    finally:
        await close_routers()
    assert out.reward_score == 0.0 and out.response_ids == [] and out.response_mask == []
    assert out.extra_fields["rollstream_status"] == "failed" and out.extra_fields["rollstream_error"]
    # No trajectory came back: verl's own tokenization of the row's prompt stands in.
    expected = worker.tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
    assert worker.tokenizer.decode(out.prompt_ids) == expected
