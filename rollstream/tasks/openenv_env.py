"""The ``openenv`` task: an OpenEnv environment (Meta / Hugging Face's environment servers) run as
it is, inside the job's sandbox. The environment is a folder in OpenEnv's layout (``models.py``,
``server/app.py`` making the FastAPI app with ``create_app``, the rest of the package beside it);
init builds, once per node, the runtime image that holds ``openenv-core`` (runtime_image.py)
and starts the sandbox from it with the folder's files in its workdir; run starts the server
there with the command its Dockerfile runs (``uvicorn server.app:app``, on a Unix socket), opens
one WebSocket session and lets the agent act through the environment's own action
(openenv_session.py); the observations' rewards give the score.

Instance: ``{"path": "/abs/env-folder"}`` (beneath the operator's ``openenv_roots``), optionally
``app`` (the ASGI app, default ``server.app:app``), ``instruction`` (what the agent is told before
the first observation), ``reset`` (keyword arguments of the environment's reset: a seed, an
episode id) and ``reward`` (``last``: the last step's reward, the default; ``sum``: the return).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from rollstream.config import load_settings
from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope
from rollstream.sandbox_spec import SandboxSpec
from rollstream.tasks import eval_report
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor_folder import (
    FolderFiles,
    HarborTaskRefused,
    TaskRoots,
    read_folder,
)
from rollstream.tasks.runtime_image import OPENENV
from rollstream.tasks.server_task import ServerTask
from rollstream.trajectory import Trajectory

INSTANCE_FIELDS = ("path", "app", "instruction", "reset", "reward")
DEFAULT_APP = "server.app:app"
APP = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,199}:[A-Za-z_][A-Za-z0-9_]{0,99}")
REWARDS = ("last", "sum")
WORKDIR = "/workspace"
ENV_DIR = f"{WORKDIR}/env"
READY_TIMEOUT_S = 120.0
INSTRUCTION = ("You act in the OpenEnv environment {name} through the step tool: each call is one action, "
               "and the environment answers with its observation, the action's reward and whether the "
               "episode is done. When it is done, call submit.")
ROOTS_SETTING = "openenv_roots (ROLLSTREAM_OPENENV_ROOTS, a JSON list)"


class OpenEnvTask(ServerTask):
    instance_fields = INSTANCE_FIELDS
    runtime = OPENENV
    tools_are = "the environment's step tool"
    name = "openenv"

    # -- instance ----------------------------------------------------------------------
    def validate(self, instance: dict) -> None:
        self.check_fields(instance)
        app = instance.get("app", DEFAULT_APP)
        if not isinstance(app, str) or not APP.fullmatch(app):
            raise InvalidJob(f"openenv: app must name the ASGI app as module:attribute (such as {DEFAULT_APP!r}), "
                             f"got {app!r}")
        if not isinstance(instance.get("reset", {}), dict):
            raise InvalidJob("openenv: reset must be an object of the environment's reset arguments")
        if instance.get("reward", "last") not in REWARDS:
            raise InvalidJob(f"openenv: reward must be one of {list(REWARDS)}, got {instance.get('reward')!r}")
        if not isinstance(instance.get("instruction", ""), str):
            raise InvalidJob("openenv: instruction must be a string")
        files = self.files(instance)
        module = app.split(":")[0].replace(".", "/")
        if f"{module}.py" not in files.files and f"{module}/__init__.py" not in files.files:
            raise InvalidJob(f"openenv: {instance['path']} has no {module}.py for app {app!r}")

    def files(self, instance: dict) -> FolderFiles:
        """The environment folder's files, checked against the operator's roots."""
        roots = TaskRoots(tuple(load_settings().openenv_roots), kind="openenv", setting=ROOTS_SETTING)
        try:
            real = roots.check(instance.get("path"))
            top = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except HarborTaskRefused as refused:
            raise InvalidJob(str(refused)) from None
        except OSError as error:
            raise InvalidJob(f"openenv: {instance.get('path')} cannot be opened as a folder ({error.strerror})") \
                from None
        try:
            return read_folder(top, "environment folder")
        except HarborTaskRefused as refused:
            raise InvalidJob(str(refused).replace("harbor:", "openenv:")) from None
        finally:
            os.close(top)

    def sandbox_spec(self, instance: dict) -> SandboxSpec:
        files: dict[str, str | bytes] = {f"env/{path}": data for path, (data, _) in self.files(instance).files.items()
                                         if "__pycache__" not in path.split("/")}
        return SandboxSpec(image=OPENENV.tag(), workdir=WORKDIR, files=files,
                           env={"HOME": "/tmp"})

    # -- run ---------------------------------------------------------------------------
    async def rollout(self, env: Envelope, ctx: TaskContext) -> Trajectory:
        instance = env.job.instance
        sandbox = self.run_sandbox(env, ctx)
        from rollstream.tasks.openenv_session import Session, SessionTools

        name = os.path.basename(str(instance["path"]).rstrip("/"))
        session = Session(sandbox, name)
        try:
            first = await session.start(ENV_DIR, instance.get("app", DEFAULT_APP), READY_TIMEOUT_S,
                                        reset=instance.get("reset") or {})
            if "error" in first:
                raise JobFailed(f"OpenEnv environment {name!r} refused its reset: {first['error']}",
                                retryable=False, failure="task")
            tools = SessionTools(session, f"Take one action in the OpenEnv environment {name}.")
            messages = self.prompt_messages(instance, name, first)
            try:
                traj = await self.act(env, ctx, messages, tools)
            except JobFailed:
                if session.broken is not None:  # the server died under a step: the environment's fault
                    raise session.broken from None
                raise
            if session.broken is not None:
                raise session.broken
        finally:
            await session.close()
        rewards = [float(r) for r in session.rewards if isinstance(r, (int, float))]
        how = instance.get("reward", "last")
        reward = (sum(rewards) if how == "sum" else rewards[-1]) if rewards else 0.0
        traj.extra["openenv"] = {"environment": name, "reward": reward, "how": how, "steps": len(session.rewards),
                                 "rewards": session.rewards, "done": session.done,
                                 "last_observation": _clipped(session.last_observation)}
        return traj

    def prompt_messages(self, instance: dict, name: str, first: dict) -> list[dict]:
        system = instance.get("instruction") or INSTRUCTION.format(name=name)
        user = f"The environment was reset. Its first observation:\n{json.dumps(first.get('observation'))}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    # -- eval --------------------------------------------------------------------------
    async def score(self, env: Envelope, ctx: TaskContext) -> float:
        found = (env.trajectory.extra.get("openenv") if env.trajectory is not None else None) or {}
        if "reward" not in found:
            return eval_report.record(env, 0.0, "the OpenEnv session left no reward")
        reason = (f"the {found['how']} reward of OpenEnv environment {found['environment']!r} after "
                  f"{found['steps']} step(s){'' if found['done'] else ' (not done)'}")
        return eval_report.record(env, float(found["reward"]), reason)


def _clipped(value: Any, max_chars: int = 4000) -> Any:
    text = json.dumps(value, default=str)
    return value if len(text) <= max_chars else {"clipped": text[:max_chars]}


TASK_SET_PREFIX = "openenv:"


def task_set(spec: str) -> list[dict] | None:
    """The jobs of ``openenv:PATH`` or ``openenv:PATH:{"field": ...}`` (a task-set name for
    ``rollstream submit``): one job of the environment folder at PATH with the instance fields
    given, or one per reset seed of ``"seeds": [...]``; None for any other spec."""
    if not spec.startswith(TASK_SET_PREFIX):
        return None
    path, _, raw = spec[len(TASK_SET_PREFIX):].partition(":")
    try:
        fields = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise InvalidJob(f"{spec}: the instance fields after the path's ':' must be a JSON object ({exc})") from None
    if not isinstance(fields, dict):
        raise InvalidJob(f"{spec}: the instance fields after the path's ':' must be a JSON object")
    seeds = fields.pop("seeds", None)
    if seeds is not None and not (isinstance(seeds, list) and seeds
                                  and all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)):
        raise InvalidJob(f"{spec}: seeds must be a non-empty list of integers (one job per reset seed)")
    instances = [{"path": path, **fields}] if seeds is None else \
        [{"path": path, **fields, "reset": {**fields.get("reset", {}), "seed": seed}} for seed in seeds]
    task = OpenEnvTask()
    for instance in instances:
        task.validate(instance)
    name = os.path.basename(path.rstrip("/"))
    return [{"task": OpenEnvTask.name, "instance": instance, "metadata": {"openenv_environment": name}}
            for instance in instances]
