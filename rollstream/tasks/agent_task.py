"""The base of every task whose run stage is an LLM agent working in a sandbox. The stages
own the sandbox (init creates it from ``sandbox_spec``, run and eval connect to it, eval
destroys it); a concrete task says what the sandbox holds, what the agent sees, which tools
it gets and how to score. The run hook here drives the agent: the built-in loop, or the
harness a job names (``agent.harness``)."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from rollstream.agent.chat import job_template
from rollstream.agent.episode import run_agent
from rollstream.agent.harness import run_harness
from rollstream.agent.tools import CallToolAdapter, ToolBox
from rollstream.episode_settings import agent_settings
from rollstream.errors import JobCancelled, JobFailed
from rollstream.messages import EVAL_STAGE, INIT_STAGE, RUN_STAGE, Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.sandboxes.tools import tool_schemas
from rollstream.tasks.base import Task, TaskContext
from rollstream.trajectory import Trajectory


class AgentTask(Task):
    """Subclasses implement ``sandbox_spec``, ``prompt_messages`` and ``reward``; they may
    override ``prepare`` (after the sandbox exists) and ``tools``."""

    tools: ClassVar[list[str]] = ["bash"]

    @abstractmethod
    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        """The sandbox this instance's agent works in."""

    @abstractmethod
    def prompt_messages(self, instance: dict) -> list[dict]:
        """The chat messages the agent starts from (system and user)."""

    @abstractmethod
    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        """Score the finished episode in its sandbox."""

    async def prepare(self, env: Envelope, sandbox: SandboxClient) -> None:
        """Extra set-up once the sandbox runs (the spec's files and commands are done)."""

    def tool_names(self, instance: dict) -> list[str]:
        return list(instance.get("tools", self.tools))

    def tool_schemas(self, instance: dict) -> list[dict]:
        """The tool schemas the chat template shows the model (the sandbox's own by default)."""
        return tool_schemas(self.tool_names(instance))

    # -- the stage hooks ---------------------------------------------------------------
    async def setup(self, env: Envelope, ctx: TaskContext) -> None:
        await self.prepare(env, _sandbox(ctx, INIT_STAGE))

    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        sandbox = _sandbox(ctx, RUN_STAGE)
        job = env.job
        messages, tools = self.prompt_messages(job.instance), self.tool_schemas(job.instance)
        if isinstance(job.agent.get("chat_template_kwargs"), dict):  # refused before the harness or the loop
            job_template(job.agent["chat_template_kwargs"])
        if job.agent.get("harness"):  # the job brings its own agent: it talks to a door of ours
            return await run_harness(str(job.agent["harness"]), messages, tools, env, ctx.services, sandbox)
        return await run_builtin_loop(env, ctx, messages, CallToolAdapter(sandbox, tools))

    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        return float(await self.reward(env, _sandbox(ctx, EVAL_STAGE)))


async def run_builtin_loop(env: Envelope, ctx: TaskContext, messages: list[dict], tools: ToolBox) -> Trajectory:
    """rollstream's own agent loop over ``tools``, with the job's agent settings and LLM session."""
    job = env.job
    llm = ctx.services.need_llm()
    settings = agent_settings(job.agent, job.sampling)
    version_at_start = await llm.policy_version()

    async def cancelled() -> bool:
        return (await ctx.cancelled()) is not None

    session = llm.session(job.job_id, job.group_id, max_backend_attempts=settings.max_backend_attempts,
                          request_timeout_s=settings.request_timeout_s, backend_wait_s=settings.backend_wait_s)
    traj = await run_agent(messages, tools, session, settings, llm.tokenizer, cancelled=cancelled)
    if traj.finish_reason == "cancelled":
        raise JobCancelled("cancelled during the agent loop")
    if traj.finish_reason == "error":  # no backend could serve the turn: try the job again
        raise JobFailed(f"agent loop failed: {traj.extra.get('finish_detail', 'backend error')}")
    if "policy_versions" not in traj.extra and traj.policy_version == 0:
        traj.policy_version = version_at_start  # backends that do not report it (vLLM)
    return traj


def _sandbox(ctx: TaskContext, stage: str) -> SandboxClient:
    if ctx.sandbox is None:
        raise JobFailed(f"{stage} stage got an agent job without a sandbox; init must create it", retryable=True)
    return ctx.sandbox
