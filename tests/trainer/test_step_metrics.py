"""Per-step metrics the RL benchmark reads: where a rollout's time went (pipeline stages and
agent phases), and the warm-up episodes of the arith recipes (right only partly, following the schema only partly)."""

from __future__ import annotations

from rollstream.messages import Result
from rollstream.tasks import arith
from rollstream.trainer.loop import stage_timings
from rollstream.trajectory import Trajectory


def _result(init_s: float, llm_s: float) -> Result:
    traj = Trajectory(prompt_ids=[1], response_ids=[2], loss_mask=[1], logprobs=[0.0],
                      timings_s={"llm_s": llm_s, "total_s": 9.0})
    return Result(job_id=f"j{init_s}", status="completed", reward=1.0, trajectory=traj,
                  timings_s={"init_s": init_s, "run_s": llm_s + 0.1})


def test_stage_timings_average_stages_and_agent_phases_over_the_batch():
    timings = stage_timings([_result(0.2, 1.0), _result(0.4, 3.0)])
    assert abs(timings["time_init_s"] - 0.3) < 1e-9
    assert abs(timings["time_llm_s"] - 2.0) < 1e-9 and abs(timings["time_run_s"] - 2.1) < 1e-9
    assert "time_total_s" not in timings


def test_arith_episodes_submit_the_tool_output_only_at_the_answer_copy_rate():
    instances = arith.make_instances(400, seed=3)
    episodes = arith.conversations(instances, answer_copy_rate=0.3, seed=1)
    right = [ep[-1]["tool_calls"][0]["function"]["arguments"]["answer"] == str(arith.expected(inst))
             for ep, inst in zip(episodes, instances)]
    assert 0.2 < sum(right) / len(right) < 0.4
    # the tool's output and the command stay right in every episode
    assert all(ep[-2]["content"] == f"{arith.expected(inst)}\n" for ep, inst in zip(episodes, instances))
    assert arith.conversations(instances[:5]) == arith.conversations(instances[:5], answer_copy_rate=1.0)


def test_arith_episodes_follow_the_submit_schema_at_the_answer_key_rate_and_always_copy_the_output():
    instances = arith.make_instances(400, seed=4)
    episodes = arith.conversations(instances, answer_key_rate=0.3, seed=2)
    arguments = [ep[-1]["tool_calls"][0]["function"]["arguments"] for ep in episodes]
    assert 0.2 < sum("answer" in a for a in arguments) / len(arguments) < 0.4
    for ep, inst, args in zip(episodes, instances, arguments):
        (key, value), = args.items()
        assert key in ("answer", "result") and value == str(arith.expected(inst)) and ep[-2]["content"] == f"{value}\n"
        assert (arith.parse_int(args) is None) == (key == "result")  # the task takes only 'answer'
    # at rate 1 no draw is made, so the episodes (and the tests' cached model) stay as they were
    assert arith.conversations(instances[:5], seed=2) == arith.conversations(instances[:5], answer_key_rate=1.0, seed=2)
