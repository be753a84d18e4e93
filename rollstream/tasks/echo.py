"""The built-in ``echo`` task: exercises every stage without an LLM. Init makes an empty work
folder, run echoes the prompt back as the response, eval scores exact match against
``expected`` (default: the prompt). Optional knobs let tests and benchmarks give a stage
a duration or make it fail: ``init_s``, ``run_s``, ``eval_s``, ``fail_in``."""

from __future__ import annotations

import asyncio
import os
import shutil

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import EVAL_STAGE, INIT_STAGE, RUN_STAGE, STAGES, Envelope
from rollstream.sandboxes.paths import safe_name
from rollstream.tasks import eval_report
from rollstream.tasks.base import Task, TaskContext
from rollstream.trajectory import Message, Trajectory

_KNOBS = {"prompt", "expected", "init_s", "run_s", "eval_s", "fail_in", "fail_times"}


class EchoTask(Task):
    name = "echo"

    def validate(self, instance: dict) -> None:
        if not isinstance(instance.get("prompt"), str):
            raise InvalidJob("echo needs instance.prompt as a string, e.g. {\"prompt\": \"hello\"}")
        unknown = set(instance) - _KNOBS
        if unknown:
            raise InvalidJob(f"echo does not know instance field(s) {sorted(unknown)}; known: {sorted(_KNOBS)}")
        for knob in ("init_s", "run_s", "eval_s"):
            if not isinstance(instance.get(knob, 0), (int, float)) or instance.get(knob, 0) < 0:
                raise InvalidJob(f"echo: {knob} must be a number of seconds ≥ 0")
        if instance.get("fail_in") not in (None, *STAGES):
            raise InvalidJob("echo: fail_in must be one of init, run, eval")

    @staticmethod
    async def _maybe_fail_or_wait(env: Envelope, stage: str) -> None:
        inst = env.job.instance
        if inst.get(f"{stage}_s"):
            await asyncio.sleep(float(inst[f"{stage}_s"]))
        # fail_times: fail only the first N attempts, so retries can succeed.
        if inst.get("fail_in") == stage and env.attempt < int(inst.get("fail_times", 10**9)):
            raise JobFailed(f"echo was asked to fail in {stage} (attempt {env.attempt})")

    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        # An empty folder, made and removed with one syscall each: echo measures the
        # broker, and file I/O here would sit on every job's critical path.
        workdir = self._workdir(env, ctx)
        try:
            os.mkdir(workdir)
        except FileExistsError:  # a retried attempt on this node
            pass
        except FileNotFoundError:  # the node's work folder is not there (yet)
            os.makedirs(workdir, exist_ok=True)
        env.state["workdir"] = workdir
        await self._maybe_fail_or_wait(env, INIT_STAGE)

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        await self._maybe_fail_or_wait(env, RUN_STAGE)
        prompt = env.job.instance["prompt"]
        return Trajectory(response_text=prompt, num_turns=1,
                          messages=[Message(role="user", content=prompt), Message(role="assistant", content=prompt)])

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        await self._maybe_fail_or_wait(env, EVAL_STAGE)
        expected = env.job.instance.get("expected", env.job.instance["prompt"])
        response = env.trajectory.response_text if env.trajectory else None
        if response == expected:
            return eval_report.record(env, 1.0, "response equals the expected text")
        return eval_report.record(env, 0.0, "response differs from the expected text", expected=expected,
                                  response=response or "")

    @staticmethod
    def _workdir(env: Envelope, ctx: TaskContext) -> str:
        """The job's folder under the node's work folder, named from its id by `safe_name`: one
        plain name whatever the id holds ('/tmp/x', '../..', a shared long prefix), so it can
        neither leave the work folder nor be another job's."""
        return os.path.join(ctx.work_dir, safe_name(env.job.job_id, 40))

    async def teardown(self, env: Envelope, ctx: TaskContext) -> None:
        # From the id again, never from env.state: a message on a stream may carry any path.
        workdir = self._workdir(env, ctx) if env.state.get("workdir") else None
        if workdir:
            try:
                os.rmdir(workdir)
            except FileNotFoundError:  # gone already: teardown is idempotent
                pass
            except OSError:  # not empty (something was put there): remove it whole
                shutil.rmtree(workdir, ignore_errors=True)
