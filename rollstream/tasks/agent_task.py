"""The base of every task whose run stage is an LLM agent working in a sandbox: init
creates the sandbox and prepares it, run drives the agent loop with the sandbox's tools,
eval scores in the same sandbox and destroys it. A concrete task says what the sandbox
holds, what the agent sees, which tools it gets and how to score."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

from rollstream.errors import JobCancelled, JobFailed
from rollstream.messages import Envelope
from rollstream.tasks.base import Task, TaskContext
from rollstream.trajectory import Trajectory


class AgentTask(Task):
    """Subclasses implement ``sandbox_spec``, ``prompt_messages`` and ``reward``; they may
    override ``prepare`` (after the sandbox exists) and ``tools``."""

    tools: ClassVar[list[str]] = ["bash"]

    @abstractmethod
    def sandbox_spec(self, instance: dict) -> Any:
        """A ``rollstream.sandboxes.SandboxSpec`` for this instance."""

    @abstractmethod
    def prompt_messages(self, instance: dict) -> list[dict]:
        """The chat messages the agent starts from (system and user)."""

    @abstractmethod
    async def reward(self, env: Envelope, sandbox: Any) -> float:
        """Score the finished episode; ``sandbox`` is a connected SandboxClient."""

    async def prepare(self, env: Envelope, sandbox: Any) -> None:
        """Extra set-up once the sandbox runs (the spec's files and commands are done)."""

    def tool_names(self, instance: dict) -> list[str]:
        return list(instance.get("tools", self.tools))

    def tool_schemas(self, instance: dict) -> list[dict]:
        """The tool schemas the chat template shows the model (the sandbox's own by default)."""
        from rollstream.sandboxes import tool_schemas

        return tool_schemas(self.tool_names(instance))

    # -- the stage hooks ---------------------------------------------------------------
    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        from rollstream.sandboxes import SandboxClient, create_sandbox
        from rollstream.sandboxes.paths import sandbox_id_for
        from rollstream.sandboxes.policy import OverridePolicy
        from rollstream.sandboxes.errors import SandboxSetupError

        spec = self.sandbox_spec(env.job.instance)
        node_backend = ctx.services.get("sandbox_backend")
        if spec.backend == "auto" and node_backend and node_backend != "auto":
            spec = spec.model_copy(update={"backend": node_backend})
        # The operator's policy decides what a job may change (the safe default without one).
        spec = (ctx.services.get("sandbox_policy") or OverridePolicy()).apply(spec, env.job.sandbox)
        try:
            handle = await create_sandbox(spec, sandbox_id=sandbox_id_for(env.job.job_id, env.attempt),
                                          owner=env.job.job_id, root_dir=ctx.services.get("sandbox_root"))
        except SandboxSetupError as exc:  # the job's own environment recipe fails: not the service's fault
            raise JobFailed(str(exc), failure="job") from exc
        env.sandbox = handle
        async with SandboxClient(handle.socket_path) as sb:
            await self.prepare(env, sb)

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        from rollstream.agent.loop import run_agent
        from rollstream.agent.settings import AgentSettings
        from rollstream.agent.tools import CallToolAdapter
        from rollstream.sandboxes import SandboxClient
        from rollstream.sandboxes.lifecycle import checked_handle

        if not env.sandbox:
            raise JobFailed("run stage got a job without a sandbox; init must create it", retryable=True)
        job = env.job
        if job.agent.get("harness"):  # the job brings its own agent: it talks to a door of ours
            from rollstream.agent.harness import run_harness

            return await run_harness(str(job.agent["harness"]), self.prompt_messages(job.instance),
                                     self.tool_schemas(job.instance), env, ctx)
        llm = ctx.service("llm")
        settings = AgentSettings.model_validate({**job.agent, "sampling": job.sampling})
        version_at_start = await llm.policy_version()

        async def cancelled() -> bool:
            return (await ctx.cancelled()) is not None

        # Paths rebuilt from the id: a handle read from a stream is not trusted.
        handle = checked_handle(env.sandbox, ctx.services.get("sandbox_root"))
        async with SandboxClient(handle.socket_path) as sb:
            tools = CallToolAdapter(sb, self.tool_schemas(job.instance))
            session = llm.session(job.job_id, job.group_id, max_backend_attempts=settings.max_backend_attempts,
                                  request_timeout_s=settings.request_timeout_s,
                                  backend_wait_s=settings.backend_wait_s)
            traj = await run_agent(self.prompt_messages(job.instance), tools, session, settings, llm.tokenizer,
                                   cancelled=cancelled)
        if traj.finish_reason == "cancelled":
            raise JobCancelled("cancelled during the agent loop")
        if traj.finish_reason == "error":  # no backend could serve the turn: try the job again
            raise JobFailed(f"agent loop failed: {traj.extra.get('finish_detail', 'backend error')}")
        if "policy_versions" not in traj.extra and traj.policy_version == 0:
            traj.policy_version = version_at_start  # backends that do not report it (vLLM)
        return traj

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        from rollstream.sandboxes import SandboxClient
        from rollstream.sandboxes.lifecycle import checked_handle

        if not env.sandbox:
            raise JobFailed("eval stage got a job without a sandbox", retryable=True)
        async with SandboxClient(checked_handle(env.sandbox, ctx.services.get("sandbox_root")).socket_path) as sb:
            return float(await self.reward(env, sb))

    async def teardown(self, env: Envelope, ctx: TaskContext) -> None:
        from rollstream.sandboxes import destroy_sandbox
        from rollstream.sandboxes.lifecycle import checked_handle

        if env.sandbox:
            await destroy_sandbox(checked_handle(env.sandbox, ctx.services.get("sandbox_root")))
