"""The code task's eval in a real sandbox: where the solution comes from, the two reward
modes, and solutions that crash, hang or flood output scoring 0 with the reason."""

from __future__ import annotations

import pytest

from rollstream.errors import InvalidJob
from rollstream.tasks.code import CodeTask, extract_code

from .conftest import needs_bwrap

ADD = {"prompt": "Write add(a, b).", "entry_point": "add", "tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4",
                                                                     "assert add(0, 0) == 0"],
       "eval_timeout_s": 10, "per_test_timeout_s": 2}


@needs_bwrap
async def test_a_solution_file_written_by_the_agent_is_scored(episode):
    ep = await episode(CodeTask(), ADD)
    async with ep.client() as sb:
        await sb.edit("create", "solution.py", file_text="def add(a, b):\n    return a + b\n")
    assert await ep.score(answer="done, see solution.py") == 1.0
    assert ep.env.trajectory.extra["eval"]["solution"] == "solution.py"


@needs_bwrap
async def test_fraction_mode_counts_cases_and_all_pass_needs_every_one(episode):
    wrong_on_zero = "def add(a, b):\n    return a + b if a else -1\n"
    ep = await episode(CodeTask(), {**ADD, "reward_mode": "fraction"})
    assert await ep.score(answer=wrong_on_zero) == pytest.approx(2 / 3)
    assert "2/3" in ep.reason and "case 2" in ep.reason
    ep2 = await episode(CodeTask(), ADD)
    assert await ep2.score(answer=wrong_on_zero) == 0.0


@needs_bwrap
@pytest.mark.parametrize("solution,reason", [
    ("def add(a, b):\n    raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("import os\nos._exit(3)\n", "crashed"),
    ("def add(a, b):\n    while True:\n        pass\n", "timed out"),
    ("def add(a, b):\n    print('x' * 10_000_000)\n    return a + b\n", "printed more than"),
    ("import sys\nsys.exit(0)\n", "SystemExit"),
    ("def add(a, b) return", "no solution"),
], ids=["raises", "exits-process", "hangs", "floods", "sys-exit", "syntax-error"])
async def test_a_solution_that_crashes_hangs_or_floods_scores_zero_with_the_reason(episode, solution, reason):
    ep = await episode(CodeTask(), {**ADD, "per_test_timeout_s": 1})
    assert await ep.score(answer=solution) == 0.0
    assert reason in ep.reason, ep.env.trajectory.extra["eval"]


@needs_bwrap
async def test_a_hang_outside_python_hits_the_eval_time_limit(episode):
    # time.sleep in C is cut by the alarm too; a blocked read of a pipe with the alarm
    # ignored is only stopped by the eval-wide limit.
    solution = ("import signal, os\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                "r, w = os.pipe()\nos.read(r, 1)\n")
    ep = await episode(CodeTask(), {**ADD, "eval_timeout_s": 2})
    assert await ep.score(answer=solution) == 0.0
    assert "timed out" in ep.reason


def test_code_is_taken_from_the_last_fenced_block_or_plain_source():
    assert extract_code("try\n```python\nx = 1\n```\nthen\n```py\ndef f():\n    pass\n```") == "def f():\n    pass\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"
    assert extract_code("I wrote the file.") is None


@pytest.mark.parametrize("bad", [{"prompt": "x"}, {"prompt": "x", "tests": []}, {"prompt": "x", "tests": "assert ("},
                                 {"prompt": "x", "tests": "assert 1", "reward_mode": "most"},
                                 {"prompt": "x", "tests": "assert 1", "entry_point": "not valid"},
                                 {"prompt": "x", "tests": "assert 1", "solution_file": "../x.py"},
                                 {"prompt": "x", "tests": "assert 1", "eval_timeout_s": -1},
                                 {"prompt": "x", "tests": "assert 1", "surprise": 1}])
def test_malformed_instances_are_rejected_at_submit(bad):
    with pytest.raises(InvalidJob):
        CodeTask().validate(bad)
