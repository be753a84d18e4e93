"""The ``harbor`` task: a Harbor / Terminal-Bench task folder run as it is. Init builds the
folder's environment image once per node (harbor_image.py) and starts the sandbox from it, the
workdir holding what the Dockerfile put there; the agent (rollstream's loop, or the job's
harness) gets ``instruction.md`` with bash and editor tools, for as long as task.toml's
``[agent] timeout_sec`` allows; eval runs ``tests/test.sh`` in a fresh sandbox made from the
pristine image plus the agent's changes to its workdir (harbor_verify.py) and reads the reward
file it writes.

Instance: ``{"path": "/abs/task-folder"}`` (beneath the operator's ``harbor_task_roots``),
optionally ``system_prompt`` (fields {workdir} and {task_name}) and ``tools``.
"""

from __future__ import annotations

import asyncio
import shlex
from typing import ClassVar

from rollstream.config import load_settings
from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import ROOT_TASK_CAPABILITIES, SandboxLimits, SandboxSpec
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.env_images import EnvBuildFailed
from rollstream.sandboxes.errors import BackendUnavailable
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import harbor_verify
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor_folder import TaskFolder
from rollstream.tasks.harbor_image import (
    DEFAULT_WORKDIR,
    LINKED,
    STATE_DIR,
    WORKDIR_TAR,
    HarborImage,
    cached,
    ensure_image,
    image_key,
)
from rollstream.tasks.prompt_template import fill_prompt
from rollstream.trajectory import Trajectory

SYSTEM_PROMPT = (
    "You are an agent working in a Linux sandbox; your working folder is {workdir}. Complete the task "
    "below with the bash and editor tools. When you are done, call submit."
)
INSTANCE_FIELDS = ("path", "system_prompt", "tools", "name")
SETUP_TIMEOUT_S = 300.0


def restore_workdir_command(workdir: str) -> str:
    """Run first in every sandbox of the task: Harbor's paths made, and the workdir's files as
    the Dockerfile left them unpacked into the sandbox's own workdir."""
    folders = " ".join(f"{STATE_DIR}/{name}" for name in LINKED)
    return (f"mkdir -p {folders} {STATE_DIR}/logs/verifier {STATE_DIR}/logs/agent && "
            f"tar -x --no-same-owner -f {WORKDIR_TAR} -C {shlex.quote(workdir)}")


class HarborTask(AgentTask):
    name = "harbor"
    tools: ClassVar[list[str]] = ["bash", "editor"]

    # -- instance ----------------------------------------------------------------------
    def validate(self, instance: dict) -> None:
        unknown = sorted(set(instance) - set(INSTANCE_FIELDS))
        if unknown:
            raise InvalidJob(f"harbor: unknown instance fields {unknown}; it takes {list(INSTANCE_FIELDS)}")
        if "tools" in instance and not (isinstance(instance["tools"], list)
                                        and all(isinstance(t, str) for t in instance["tools"])):
            raise InvalidJob("harbor: tools must be a list of tool names such as [\"bash\", \"editor\"]")
        self.folder(instance)
        self.prompt_messages(instance)

    def folder(self, instance: dict) -> TaskFolder:
        """The instance's task folder, checked against the operator's roots and read."""
        return TaskFolder.load(instance.get("path"))

    def image(self, instance: dict) -> HarborImage:
        """The folder's environment image as built on this node (init builds it first)."""
        folder = self.folder(instance)
        key = image_key(folder, load_settings().harbor_base_images)[0]
        image = cached(key)
        if image is None:
            raise JobFailed(f"harbor task {folder.name}: its environment image ({key}) is not built on this node; "
                            "init builds it (prepare_environment) before the sandbox starts", retryable=True)
        return image

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        folder = self.folder(instance)
        image = self.image(instance)
        resources = folder.config.environment
        limits = SandboxLimits(memory_mb=resources.memory_mb, disk_mb=resources.storage_mb, cpus=resources.cpus)
        root = not image.user or image.user in ("root", "0")
        # Harbor runs a task's container with Docker's default capabilities, and its solve.sh and
        # test.sh as root expect them (tar restoring owners, writing files other users own): a
        # root task's container keeps the few of them SECURITY.md argues for, within the operator's.
        return SandboxSpec(image=image.tag, workdir=image.workdir, limits=limits,
                           setup_commands=[restore_workdir_command(image.workdir)], setup_timeout_s=SETUP_TIMEOUT_S,
                           env={**(image.env or {}), "HOME": "/root" if root else "/tmp"},
                           capabilities=list(ROOT_TASK_CAPABILITIES) if root else [])

    def prompt_messages(self, instance: dict) -> list[dict]:
        folder = self.folder(instance)
        # At submit the image may not be built yet: the prompt then names Terminal-Bench's /app.
        image = cached(image_key(folder, load_settings().harbor_base_images)[0])
        system = fill_prompt(instance.get("system_prompt", SYSTEM_PROMPT), task_name=folder.name,
                             workdir=image.workdir if image is not None else DEFAULT_WORKDIR)
        return [{"role": "system", "content": system}, {"role": "user", "content": folder.instruction}]

    # -- init --------------------------------------------------------------------------
    async def prepare_environment(self, env: Envelope, ctx: TaskContext) -> None:
        """Build the environment image unless cached (its rootfs too where bwrap runs it)."""
        folder = await asyncio.to_thread(self.folder, env.job.instance)
        backend = (env.job.sandbox or {}).get("backend") or (ctx.sandboxes.backend if ctx.sandboxes else "auto")
        rootfs = backend == "bwrap" or (backend == "auto" and BwrapBackend().available())
        try:
            await asyncio.to_thread(ensure_image, folder, load_settings().harbor_base_images, rootfs)
        except EnvBuildFailed as failed:
            raise JobFailed(f"harbor task {folder.name}: environment/Dockerfile did not build: {failed}",
                            retryable=False, failure="task") from None
        except (BackendUnavailable, RuntimeError, OSError) as error:
            raise JobFailed(f"harbor task {folder.name}: the container engine could not build its environment "
                            f"({error}); check DOCKER_HOST and the engine (scripts/install-podman)") from error

    # -- run ---------------------------------------------------------------------------
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        """The agent's episode, limited by task.toml's ``[agent] timeout_sec`` unless the job sets
        its own ``max_wall_time_s``."""
        limit = (await asyncio.to_thread(self.folder, env.job.instance)).config.agent.timeout_sec
        if limit is not None and "max_wall_time_s" not in env.job.agent:
            env.job.agent = {**env.job.agent, "max_wall_time_s": limit}
        return await super().rollout(env, ctx)

    # -- eval --------------------------------------------------------------------------
    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        """tests/test.sh in a fresh sandbox, never in the agent's own (harbor_verify.py)."""
        folder = await asyncio.to_thread(self.folder, env.job.instance)
        return await harbor_verify.score(env, ctx, folder, self.sandbox_spec(env.job.instance))

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        raise JobFailed("the harbor task is scored by score() in a fresh sandbox, never in the agent's own "
                        "sandbox; call HarborTask().score(env, ctx) with ctx.sandboxes set", retryable=False)
