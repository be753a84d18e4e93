"""Trajectory.extra's well-known keys are typed (rollstream.trajectory.TrajectoryExtra) while the wire
stays what it was: a result written with extra as a plain map (as before the keys were typed) loads
with every key, user keys included, and packs again to the very same bytes; a known key of the
wrong shape is refused when the result is read."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import ValidationError

from rollstream.messages import Result
from rollstream.pipeline.codec import pack, unpack
from rollstream.trajectory import Trajectory

# Known and user keys interleaved, in the order a writer happened to set them.
EXTRA = {"finish_detail": "the harness exited with status 0", "my_task_note": {"steps": [1, None, 2.5]},
         "answer": {"patch": "diff --git"}, "harness": "codex", "door": {"requests": 4, "refused": 1},
         "calls": [{"segment": 0, "prompt_tokens": 12}], "policy_versions": [3, 4], "backends": ["a", "b"],
         "eval": {"reward": 1.0, "reason": "4/4 tests passed", "passed": 4}, "warnings": ["ran offline"],
         "zz_last": True}


def _result_bytes(extra: dict) -> bytes:
    """A result packed as plain msgpack, not through the model: what an older writer sent."""
    traj = {"prompt_ids": [1, 2], "response_ids": [3, 4], "loss_mask": [1, 0], "logprobs": [-0.5, 0.0],
            "messages": [], "response_text": "", "reward": 1.0, "finish_reason": "stop", "num_turns": 1,
            "backend": None, "policy_version": 3, "tool_calls": [], "timings_s": {}, "extra": extra, "segments": []}
    result = Result(job_id="j1", group_id=None, task="echo", status="completed", reward=1.0)
    raw = result.model_dump(mode="python")
    raw["trajectory"] = traj
    return msgpack.packb(raw, use_bin_type=True)


def test_a_result_written_with_a_plain_extra_loads_every_key_and_packs_to_the_same_bytes():
    data = _result_bytes(EXTRA)
    result = unpack(Result, data)
    assert result.trajectory is not None
    assert list(result.trajectory.extra) == list(EXTRA) and result.trajectory.extra == EXTRA
    extra = result.trajectory.extra
    assert extra["door"]["refused"] == 1 and extra["my_task_note"]["steps"][1] is None
    assert pack(result) == data


@pytest.mark.parametrize(("key", "value"), [("door", {"requests": "many"}), ("policy_versions", "3,4"),
                                            ("finish_detail", {"why": "x"}), ("warnings", "one")])
def test_a_known_extra_key_of_the_wrong_shape_is_refused_when_read(key, value):
    with pytest.raises(ValidationError) as refused:
        unpack(Result, _result_bytes({**EXTRA, key: value}))
    assert f"trajectory.extra.{key}" in str(refused.value)


def test_a_trajectory_built_in_code_keeps_keys_in_the_order_they_were_set():
    traj = Trajectory()
    traj.extra["zeta"] = 1
    traj.extra["answer"] = 42
    traj.extra["alpha"] = [1]
    again = Trajectory.model_validate_json(traj.model_dump_json())
    assert list(again.extra) == ["zeta", "answer", "alpha"] and again.model_dump_json() == traj.model_dump_json()
