"""Harness validation of the shipped math and code task files: through the task hooks
and a real sandbox, the known right answer scores 1 and a wrong one 0."""

from __future__ import annotations

import json

import pytest

from rollstream.tasks.code import CodeTask
from rollstream.tasks.math import MathTask

from .conftest import data_file, needs_bwrap

MATH = [json.loads(line)["instance"] for line in data_file("math.jsonl").read_text().splitlines()]
CODE = [json.loads(line)["instance"] for line in data_file("code.jsonl").read_text().splitlines()]
pytestmark = needs_bwrap


async def test_every_shipped_math_answer_scores_one_and_a_wrong_answer_zero(episode):
    # One sandbox per instance is what the pipeline does; math's eval needs no sandbox, so
    # the checker runs for every instance on the first one's envelope too.
    ep = await episode(MathTask(), MATH[0])
    for inst in MATH:
        ep.env.job.instance = inst
        assert await ep.score(answer=inst["answer"]) == 1.0, inst
        assert await ep.score(response_text=f"so the answer is \\boxed{{{inst['answer']}}}.") == 1.0, inst
        assert await ep.score(answer="-12345") == 0.0, inst
        assert "differs" in ep.reason


async def test_math_without_any_answer_scores_zero_with_the_reason(episode):
    ep = await episode(MathTask(), MATH[0])
    assert await ep.score(response_text="I could not solve it.") == 0.0
    assert "no answer" in ep.reason


@pytest.mark.parametrize("inst", CODE, ids=[c["id"] for c in CODE])
async def test_shipped_code_reference_solution_scores_one_and_a_stub_zero(episode, inst):
    ep = await episode(CodeTask(), inst)
    assert await ep.score(answer=f"```python\n{inst['reference_solution']}```") == 1.0, ep.env.trajectory.extra
    stub = f"def {inst['entry_point']}(*args, **kwargs):\n    raise NotImplementedError\n"
    assert await ep.score(answer=stub) == 0.0
