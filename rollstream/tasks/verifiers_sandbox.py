"""The job's sandbox in place of Prime's remote sandboxes, for verifiers environments built on
``vf.SandboxEnv`` (its ``bash`` tool, and set-up or scoring code that runs commands through the
environment's ``sandbox_client``). The stand-in keeps the calls SandboxEnv makes of
``prime_sandboxes``' client (create, wait_for_creation, execute_command, delete, bulk_delete,
teardown): "creating" a sandbox names the job's own, made by init from the task's spec; each
command runs in it through the harness context (timeouts, a lost sandbox and the tool-call record
as for any harness); deleting is left to the stage that ends the job on this node."""

from __future__ import annotations

import contextvars
import shlex
from types import SimpleNamespace
from typing import Any

# The harness context of the episode running in this asyncio task (set by verifiers_episode.run).
current_episode: contextvars.ContextVar[Any] = contextvars.ContextVar("verifiers_episode", default=None)


def is_sandbox_env(env: Any) -> bool:
    """Whether ``env`` runs its commands in a sandbox (verifiers' SandboxEnv and its subclasses)."""
    try:
        from verifiers.legacy.envs.sandbox_env import SandboxEnv
    except ImportError:  # prime-sandboxes missing: no environment can be one
        return False
    return isinstance(env, SandboxEnv)


class JobSandboxClient:
    """What a SandboxEnv's ``sandbox_client`` becomes on a rollstream worker (one per environment,
    shared by its concurrent episodes: each sandbox id is an episode's job id)."""

    def __init__(self) -> None:
        self.episodes: dict[str, Any] = {}

    def _episode(self, sandbox_id: str) -> Any:
        episode = self.episodes.get(sandbox_id)
        if episode is None:
            raise RuntimeError(f"no running episode owns sandbox {sandbox_id!r}: a verifiers SandboxEnv runs its "
                               "commands in the job's sandbox only while the job's episode runs")
        return episode

    async def create(self, request: Any = None, **_: Any) -> SimpleNamespace:
        episode = current_episode.get()
        if episode is None or episode.sandbox is None:
            raise RuntimeError("a verifiers SandboxEnv asked for a sandbox outside a rollstream episode with one")
        self.episodes[episode.job_id] = episode
        return SimpleNamespace(id=episode.job_id, name=getattr(request, "name", "sandbox-env"), status="RUNNING")

    async def wait_for_creation(self, sandbox_id: str, *_: Any, **__: Any) -> None:
        self._episode(sandbox_id)

    async def execute_command(self, sandbox_id: str, command: str, working_dir: str | None = None,
                              timeout: float | None = None, **_: Any) -> SimpleNamespace:
        episode = self._episode(sandbox_id)
        if working_dir:
            command = f"cd {shlex.quote(working_dir)} && {command}"
        arguments: dict[str, Any] = {"command": command}
        if timeout:
            arguments["timeout"] = min(float(timeout), 3600.0)
        output = await episode.call_tool("bash", arguments)
        return SimpleNamespace(stdout=output, stderr="", exit_code=0)

    async def delete(self, sandbox_id: str, *_: Any, **__: Any) -> None:
        self.episodes.pop(sandbox_id, None)

    async def bulk_delete(self, sandbox_ids: list[str], *_: Any, **__: Any) -> None:
        for sandbox_id in sandbox_ids:
            self.episodes.pop(sandbox_id, None)

    def teardown(self) -> None:
        self.episodes.clear()


def adopt(env: Any) -> Any:
    """``env`` with its commands run in the jobs' sandboxes, if it is a SandboxEnv."""
    if is_sandbox_env(env) and not isinstance(env.sandbox_client, JobSandboxClient):
        env.sandbox_client.teardown()  # the remote client's thread pool, never used
        env.sandbox_client = JobSandboxClient()
    return env
