"""Through the real pipeline (Redis streams, stage workers, bwrap sandboxes): an eval that
crashes, hangs or floods output ends as a failed or zero-reward result with its reason,
and the workers go on to score the next job. The run stage is scripted (no LLM): a
test-only task returns the trajectory an agent would have produced."""

from __future__ import annotations

from rollstream.client import AsyncClient
from rollstream.messages import Envelope
from rollstream.tasks.base import TaskContext
from rollstream.tasks.code import CodeTask
from rollstream.tasks.registry import register_task
from rollstream.trajectory import Trajectory

from .conftest import needs_bwrap, workers

pytestmark = needs_bwrap


@register_task
class ScriptedCodeTask(CodeTask):
    """The code task with the agent replaced by the answer in the job's metadata."""

    name = "code-scripted"

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        return Trajectory(extra={"answer": env.job.metadata["answer"]}, num_turns=1)


@register_task
class CrashingEvalTask(ScriptedCodeTask):
    name = "code-crashing-eval"

    async def reward(self, env: Envelope, sandbox) -> float:
        raise RuntimeError("the reward function itself blew up")


ADD = {"prompt": "Write add(a, b).", "entry_point": "add", "tests": ["assert add(1, 2) == 3"],
       "eval_timeout_s": 3, "per_test_timeout_s": 1}
GOOD = "def add(a, b):\n    return a + b\n"


def job(task: str, answer: str, name: str, **instance) -> dict:
    return {"task": task, "instance": {**ADD, **instance}, "metadata": {"answer": answer, "name": name}}


async def test_crashing_hanging_and_flooding_evals_end_with_reasons_and_workers_go_on(pipeline_settings):
    jobs = [
        job("code-scripted", "def add(a, b):\n    while True:\n        pass\n", "hang"),
        job("code-scripted", "import signal, os\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                             "os.read(os.pipe()[0], 1)\n", "hang-past-eval-limit", eval_timeout_s=2),
        job("code-scripted", "def add(a, b):\n    print('x' * 20_000_000)\n    return a + b\n", "flood"),
        job("code-scripted", "import os\nos._exit(1)\n", "crash"),
        job("code-crashing-eval", GOOD, "reward-raises"),
    ]
    async with workers(pipeline_settings), AsyncClient(settings=pipeline_settings) as client:
        await client.submit_many(jobs)
        first = {r.metadata["name"]: r for r in await client.collect(len(jobs), timeout_s=120)}
        # The same workers then score a good job as usual.
        await client.submit(job("code-scripted", GOOD, "after"))
        [after] = await client.collect(1, timeout_s=60)

    def reason(name: str) -> str:
        return first[name].trajectory.extra["eval"]["reason"]

    for name in ("hang", "hang-past-eval-limit", "flood", "crash"):
        assert first[name].status == "completed" and first[name].reward == 0.0, (name, first[name])
    assert "timed out" in reason("hang")
    assert "timed out" in reason("hang-past-eval-limit")
    assert "printed more than" in reason("flood")
    assert "crashed" in reason("crash")
    crashed = first["reward-raises"]
    assert crashed.status == "failed" and "the reward function itself blew up" in crashed.error
    assert after.status == "completed" and after.reward == 1.0
