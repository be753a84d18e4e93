"""The job's typed vocabulary: its agent and sandbox overrides name only fields of the settings
they override (a misspelt knob is refused at the door, not ignored at a stage), and an envelope
carries its sandbox handle as a model, on the wire as the same map as before."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollstream.episode_settings import AgentOverrides, AgentSettings
from rollstream.messages import Envelope, Job
from rollstream.pipeline.codec import pack, unpack
from rollstream.sandbox_spec import LimitsOverrides, SandboxHandle, SandboxLimits, SandboxOverrides, SandboxSpec


def test_overrides_name_exactly_the_fields_they_override():
    assert set(AgentOverrides.__annotations__) == set(AgentSettings.model_fields) - {"sampling"} | {"harness"}
    assert set(SandboxOverrides.__annotations__) == set(SandboxSpec.model_fields)
    assert set(LimitsOverrides.__annotations__) == set(SandboxLimits.model_fields)


@pytest.mark.parametrize("field, value, where", [("agent", {"max_turn": 3}, "agent.max_turn"),
                                                 ("agent", {"max_turns": "many"}, "agent.max_turns"),
                                                 ("sandbox", {"privileged": True}, "sandbox.privileged"),
                                                 ("sandbox", {"limits": {"memory": 1}}, "sandbox.limits.memory")])
def test_a_misspelt_or_mistyped_override_is_refused_naming_it(field, value, where):
    with pytest.raises(ValidationError, match=where.replace(".", r"\.")):
        Job(task="echo", **{field: value})


def test_overrides_travel_as_the_submitter_wrote_them_and_the_handle_as_a_model():
    job = Job(task="arith", agent={"harness": "openai-chat", "max_turns": 3}, sandbox={"limits": {"cpus": 0.5}})
    handle = SandboxHandle(id="sb1", backend="bwrap", socket_path="/s/sb1/sock", supervisor_pid=7, workdir="/w")
    back = unpack(Envelope, pack(Envelope(job=job, sandbox=handle, state={"made": True})))
    assert back.job.agent == {"harness": "openai-chat", "max_turns": 3}
    assert back.job.sandbox == {"limits": {"cpus": 0.5}}
    assert back.sandbox == handle and back.state == {"made": True}
