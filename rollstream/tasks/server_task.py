"""The base of the tasks whose environment is a server of an ecosystem's own, run inside the job's
sandbox from a runtime image (runtime_image.py) and driven from the run worker (OpenEnv:
openenv_env.py, NeMo Gym: nemo_gym_env.py): init builds the image, run refuses what such a job
cannot do, and the agent is rollstream's own loop over the tools the server's protocol gives."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.tasks.base import Task, TaskContext
from rollstream.tasks.runtime_image import RuntimeImage
from rollstream.trajectory import Trajectory

if TYPE_CHECKING:  # the CLI imports the tasks (their task sets): the run stage's clients load in act only
    from rollstream.agent.tools import ToolBox
    from rollstream.sandboxes.sandbox_client import SandboxClient


class ServerTask(Task):
    """Subclasses set ``runtime``, ``instance_fields`` and ``tools_are`` (what the agent acts
    through, for errors), and validate their instances after ``check_fields``."""

    runtime: ClassVar[RuntimeImage]
    instance_fields: ClassVar[tuple[str, ...]]
    tools_are: ClassVar[str]

    def check_fields(self, instance: dict) -> None:
        unknown = sorted(set(instance) - set(self.instance_fields))
        if unknown:
            raise InvalidJob(f"{self.name}: unknown instance fields {unknown}; it takes {list(self.instance_fields)}")

    async def prepare_environment(self, env: Envelope, ctx: TaskContext) -> None:
        """Build the runtime image unless this node has it (its rootfs too where bwrap runs it)."""
        await self.runtime.prepare(env, ctx)

    def run_sandbox(self, env: Envelope, ctx: TaskContext) -> SandboxClient:
        """The job's sandbox at run, or why the job cannot run."""
        if ctx.sandbox is None:
            raise JobFailed(f"run stage got a {self.name} job without a sandbox; init must create it", retryable=True)
        if env.job.agent.get("harness"):
            raise JobFailed(f"a {self.name} job's agent acts through {self.tools_are} in rollstream's own loop; "
                            "leave agent.harness unset", retryable=False, failure="job")
        return ctx.sandbox

    async def act(self, env: Envelope, ctx: TaskContext, messages: list[dict], tools: ToolBox) -> Trajectory:
        """The agent's episode: rollstream's loop over the server's tools."""
        from rollstream.tasks.agent_task import run_builtin_loop

        return await run_builtin_loop(env, ctx, messages, tools)
