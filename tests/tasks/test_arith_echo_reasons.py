"""arith and echo keep the promise every task keeps: a result says why its reward is what it
is (``trajectory.extra["eval"]["reason"]``)."""

from __future__ import annotations

import pytest

from rollstream.tasks.arith import ArithTask
from rollstream.tasks.echo import EchoTask

from .conftest import needs_bwrap

pytestmark = needs_bwrap


@pytest.mark.parametrize(("answer", "reward", "says"), [
    ({"answer": "7"}, 1.0, "matches"),
    ({"answer": "8"}, 0.0, "differs"),
    ({"answer": "seven"}, 0.0, "not an integer"),
    ({"result": "7"}, 0.0, "without its 'answer'"),
    (None, 0.0, "never called submit"),
])
async def test_arith_result_says_why_its_reward_is_what_it_is(episode, answer, reward, says):
    ep = await episode(ArithTask(), {"a": 3, "op": "+", "b": 4})
    assert await ep.score(answer=answer) == reward
    assert says in ep.reason


@pytest.mark.parametrize(("response", "reward", "says"), [("hi", 1.0, "equals"), ("ho", 0.0, "differs")])
async def test_echo_result_says_why_its_reward_is_what_it_is(episode, response, reward, says):
    ep = await episode(EchoTask(), {"prompt": "hi"})
    assert await ep.score(response_text=response) == reward
    assert says in ep.reason
