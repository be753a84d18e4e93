"""The ``harbor`` task: a Harbor / Terminal-Bench task folder run as it is. Init builds the
folder's environment image once per node (harbor_image.py) and starts the sandbox from it, the
workdir holding what the Dockerfile put there; the agent (rollstream's loop, or the job's
harness) gets ``instruction.md`` with bash and editor tools, for as long as task.toml's
``[agent] timeout_sec`` allows; eval runs ``tests/test.sh`` in a fresh sandbox made from the
pristine image plus the agent's changes to its workdir (harbor_verify.py) and reads the reward
file it writes.

The network: ``[environment] allow_internet`` (Harbor's default true) is honoured only where the
operator grants it (setting ``task_internet``); then the agent's and the verifier's sandboxes run
on the container engine's private network (backend docker: bwrap and Singularity can only share
the host's network namespace, whose loopback holds Redis, the door and the model servers). Not
granted, a task that says ``allow_internet = true`` is refused at init, before anything runs (its
author says it needs the network: offline it would score 0 for a reason not the agent's, a
false signal to train on); one that only inherits the default (most of Terminal-Bench: its
test-time installers are moved to the image build, harbor_legacy.py) runs offline and its
trajectory says so in ``extra["warnings"]``.

A compose file's services besides ``main`` run as sidecars beside the agent's container
(harbor_compose.py), so such a task also runs on the docker backend.

Instance: ``{"path": "/abs/task-folder"}`` (beneath the operator's ``harbor_task_roots``),
optionally ``system_prompt`` (fields {workdir} and {task_name}) and ``tools``.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from typing import ClassVar

from rollstream.config import load_settings
from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import ROOT_TASK_CAPABILITIES, SandboxLimits, SandboxSpec
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.env_images import EnvBuildFailed, build_network
from rollstream.sandboxes.errors import BackendUnavailable
from rollstream.sandboxes.images import sif_from_engine_image
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks import harbor_compose, harbor_verify
from rollstream.tasks.agent_task import AgentTask
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor_folder import HarborTaskRefused, TaskFolder
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
INTERNET_SETTING = "task_internet (ROLLSTREAM_TASK_INTERNET)"
# The one backend whose network is a namespace of its own (the engine's bridge); bwrap and
# Singularity can only share the host's.
NETWORK_BACKEND = "docker"


def gets_network(folder: TaskFolder, granted: bool) -> bool:
    """Whether the task's sandboxes get the network: it asks (allow_internet, Harbor's default
    true) and the operator grants it. A task that says allow_internet = true where it is not
    granted is refused (HarborTaskRefused)."""
    environment = folder.config.environment
    if not environment.allow_internet or granted:
        return environment.allow_internet
    if "allow_internet" in environment.model_fields_set:
        raise HarborTaskRefused(
            f"harbor task {folder.name}: task.toml says allow_internet = true and this node gives sandboxes no "
            f"network; the operator grants it with {INTERNET_SETTING} (the container engine's private network), "
            "or the task says allow_internet = false to run offline")
    return False


def offline_warning(folder: TaskFolder) -> str:
    return (f"harbor task {folder.name} ran offline: task.toml leaves allow_internet to Harbor's default (true) "
            f"and this node grants no network ({INTERNET_SETTING}); a step that downloads fails")


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
        harbor_compose.load(self.folder(instance))
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
        settings = load_settings()
        network = gets_network(folder, settings.task_internet)
        compose = harbor_compose.load(folder)
        services = harbor_compose.sidecar_specs(compose, image.key, settings.harbor_base_images) if compose else []
        # Harbor runs a task's container with Docker's default capabilities, and its solve.sh and
        # test.sh as root expect them (tar restoring owners, writing files other users own): a
        # root task's container keeps the few of them SECURITY.md argues for, within the operator's.
        return SandboxSpec(image=image.tag, workdir=image.workdir, limits=limits, network=network, services=services,
                           depends_on=compose.main_depends_on if compose else {},
                           **({"backend": NETWORK_BACKEND} if network or services else {}),
                           setup_commands=[restore_workdir_command(image.workdir)], setup_timeout_s=SETUP_TIMEOUT_S,
                           env={**(image.env or {}), **(compose.main_env if compose else {}),
                                "HOME": "/root" if root else "/tmp"},
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
        settings = load_settings()
        compose = await asyncio.to_thread(harbor_compose.load, folder)
        needs = ("the network" if gets_network(folder, settings.task_internet) else
                 "its compose file's services" if compose else None)
        backend = (env.job.sandbox or {}).get("backend") or (NETWORK_BACKEND if needs else None) or (
            ctx.sandboxes.backend if ctx.sandboxes else "auto")
        if needs and backend != NETWORK_BACKEND:
            raise HarborTaskRefused(f"harbor task {folder.name}: its sandbox needs {needs}, on a network of its own, "
                                    f"which only backend {NETWORK_BACKEND!r} gives (bwrap and Singularity can only "
                                    f"share the host's); the job asks for {backend!r}")
        rootfs = backend == "bwrap" or (backend == "auto" and BwrapBackend().available())
        try:
            image = await asyncio.to_thread(ensure_image, folder, settings.harbor_base_images, rootfs)
            if compose:
                await asyncio.to_thread(harbor_compose.ensure_sidecars, folder, compose, image.key,
                                        settings.harbor_base_images, build_network())
            if backend == "singularity":  # the same image as a SIF, which the backend finds by its tag
                await asyncio.to_thread(sif_from_engine_image, image.tag)
        except EnvBuildFailed as failed:
            raise JobFailed(f"harbor task {folder.name}: its environment did not build: {failed}",
                            retryable=False, failure="task") from None
        except (BackendUnavailable, RuntimeError, OSError, subprocess.CalledProcessError) as error:
            raise JobFailed(f"harbor task {folder.name}: the container engine could not build its environment "
                            f"({error}); check DOCKER_HOST and the engine (scripts/install-podman), and for "
                            "Singularity apptainer or singularity on PATH") from error

    # -- run ---------------------------------------------------------------------------
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        """The agent's episode, limited by task.toml's ``[agent] timeout_sec`` unless the job sets
        its own ``max_wall_time_s``."""
        folder = await asyncio.to_thread(self.folder, env.job.instance)
        limit = folder.config.agent.timeout_sec
        if limit is not None and "max_wall_time_s" not in env.job.agent:
            env.job.agent = {**env.job.agent, "max_wall_time_s": limit}
        trajectory = await self.agent_rollout(env, ctx)
        if folder.config.environment.allow_internet and not load_settings().task_internet:
            trajectory.extra.setdefault("warnings", []).append(offline_warning(folder))
        return trajectory

    async def agent_rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        """The agent's own episode (AgentTask's loop or the job's harness)."""
        return await super().rollout(env, ctx)

    # -- eval --------------------------------------------------------------------------
    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        """tests/test.sh in a fresh sandbox, never in the agent's own (harbor_verify.py)."""
        folder = await asyncio.to_thread(self.folder, env.job.instance)
        return await harbor_verify.score(env, ctx, folder, self.sandbox_spec(env.job.instance))

    async def reward(self, env: Envelope, sandbox: SandboxClient) -> float:
        raise JobFailed("the harbor task is scored by score() in a fresh sandbox, never in the agent's own "
                        "sandbox; call HarborTask().score(env, ctx) with ctx.sandboxes set", retryable=False)
