"""The sandbox wire's and plan's types (runtime/protocol.py, runtime/plan.py) held against what a
real supervisor answers and what the backends write: a key the types name that never comes, or
one that comes unnamed, fails here, so the types cannot drift from the runtime they describe."""

from __future__ import annotations

from dataclasses import fields
from typing import get_type_hints

from rollstream.sandboxes import SandboxSpec
from rollstream.sandboxes.backends.base import LaunchPlan, SandboxLayout
from rollstream.sandboxes.backends.common import base_plan
from rollstream.sandboxes.runtime import protocol
from rollstream.sandboxes.runtime.plan import Plan, SharedPlanFields

from .conftest import needs_bwrap


def _keys(kind) -> set[str]:
    return set(kind.__required_keys__ | kind.__optional_keys__)


@needs_bwrap
async def test_every_op_of_a_real_supervisor_answers_the_keys_its_type_names(sb):
    answers = [
        (protocol.PingResult, await sb.request("ping")),
        (protocol.BashResult, await sb.request("bash", command="echo hi", timeout_s=30)),
        (protocol.IPythonResult, await sb.request("ipython", code="6*7", timeout_s=60)),
        (protocol.EditResult, await sb.request("edit", command="create", path="a.txt", file_text="x\n")),
        (protocol.WriteFileResult, await sb.request("write_file", path="b.txt", data=b"y")),
        (protocol.ReadFileResult, await sb.request("read_file", path="b.txt")),
        (protocol.CloseSessionResult, await sb.request("close_session", session="main")),
        (protocol.InfoResult, await sb.request("info")),
    ]
    for kind, answer in answers:
        assert set(answer) == _keys(kind), kind.__name__
    assert answers[1][1]["output"] == b"hi\n" and answers[5][1]["data"] == b"y"


def test_the_runtimes_plan_type_is_the_plan_every_backend_writes(tmp_path):
    # plan.json is LaunchPlan.to_json_dict(): the runtime's reading of it names each field, as typed
    assert get_type_hints(Plan) == get_type_hints(LaunchPlan)
    assert _keys(Plan) == {f.name for f in fields(LaunchPlan)}
    layout = SandboxLayout.of(str(tmp_path), "s1")
    assert set(base_plan(SandboxSpec(backend="local"), layout, "s1", "job-s1", "local")) == _keys(SharedPlanFields)
