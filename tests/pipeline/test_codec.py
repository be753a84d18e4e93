"""The wire codec: ormsgpack's direct packing of a model gives the very bytes that
``msgpack.packb(model.model_dump())`` gives, for every message type and the values jobs
carry; what ormsgpack refuses still packs (or fails) as msgpack would; bad bytes are a
DecodeError that names the problem."""

from __future__ import annotations

import msgpack
import pytest

from rollstream.messages import DeadLetter, Envelope, Job, Result
from rollstream.pipeline.codec import DecodeError, decode_envelope, pack, unpack, unpack_raw
from rollstream.sampling import SamplingParams
from rollstream.sandbox_spec import SandboxHandle
from rollstream.trajectory import Message, ToolCallRecord, Trajectory


def _trajectory() -> Trajectory:
    return Trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5, 70000], loss_mask=[1, 0, 1],
                      logprobs=[-0.5, 0.0, -1e-9],
                      messages=[Message(role="user", content="héllo ✓"),
                                Message(role="assistant", content="", tool_calls=[{"id": "c"}])],
                      response_text="x" * 300, reward=1.0, finish_reason="max_turns", num_turns=2,
                      tool_calls=[ToolCallRecord(name="bash", arguments={"cmd": "ls"}, duration_ms=0.4)],
                      timings_s={"llm": 0.25}, extra={"nested": {"deep": [1, None, True, 2.5]}})


def _messages() -> list:
    job = Job(task="echo", instance={"prompt": "p", "ints": {1: "one"}, "tuple": (1, 2), "neg": -2**63,
                                     "big": 2**64 - 1, "blob": b"\x00\xff", "empty": {}},
              group_id="g", submitter="alice", sampling=SamplingParams(max_tokens=7, stop=["\n"], vendor_knob=[1, 2]),
              agent={"max_turns": 3}, sandbox={"image": "python:3.12"}, metadata={"k": 1.5})
    sandbox = SandboxHandle(id="sb1", backend="bwrap", socket_path="/s/sb1/sock", supervisor_pid=7,
                            workdir="/workspace")
    env = Envelope(job=job, attempt=1, node="n1", sandbox=sandbox, state={"workdir": "/w"},
                   trajectory=_trajectory(), reward=0.5, timings_s={"init_s": 0.001}, errors=["run: boom"])
    result = Result(job_id=job.job_id, group_id="g", submitter="alice", task="echo", status="completed",
                    reward=1.0, trajectory=_trajectory(), timings_s={"run_s": 0.2}, metadata={"k": [1]})
    letter = DeadLetter(job_id=None, submitter=None, stage="run", error="bad", raw=b"\xc1", envelope=env)
    return [job, Envelope(job=Job(task="echo")), env, result, letter]


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_packs_the_bytes_msgpack_packs(message):
    expected = msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)
    assert pack(message) == expected
    # and reads back as msgpack-python reads it (tuples come back as lists either way)
    assert unpack(type(message), expected) == type(message).model_validate(
        msgpack.unpackb(expected, raw=False, strict_map_key=False))


def test_what_ormsgpack_refuses_takes_msgpacks_path():
    job = Job(task="echo", instance={"prompt": "p", "huge": 2**64})  # over ormsgpack's 64 bits
    with pytest.raises(OverflowError):  # msgpack's own error: neither can pack it
        pack(job)
    with pytest.raises(UnicodeEncodeError):  # a lone surrogate: the submit path reports it
        pack(Job(task="echo", instance={"prompt": "\ud800"}))


def test_bare_job_and_json_entries_decode():
    job = Job(task="echo", instance={"prompt": "p"})
    assert decode_envelope({b"data": pack(job)}).job == job
    assert decode_envelope({b"json": job.model_dump_json().encode()}).job == job


@pytest.mark.parametrize("data, words", [(b"\xc1 not msgpack", "not msgpack"), (b"", "not msgpack"),
                                         (msgpack.packb({"a": msgpack.ExtType(1, b"x")}), "not msgpack")])
def test_bad_bytes_are_a_decode_error(data, words):
    with pytest.raises(DecodeError, match=words):
        unpack_raw(data)
