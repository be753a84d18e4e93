"""create_sandbox / destroy_sandbox: the init stage starts a sandbox, the eval stage ends it.

create_sandbox writes the backend's LaunchPlan next to the sandbox's folders and has the
node's fork server fork a supervisor for it (its own session, so it outlives the caller);
it returns once the supervisor's socket is listening and the spec's files and setup
commands are in place.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time

from rollstream.sandbox_spec import SANDBOX_ID_PATTERN, SandboxHandle, SandboxSpec

from .backends import SandboxLayout, select_backend
from .backends.common import write_plan
from .errors import (
    SERVICE_FAILED_MARK,
    SandboxError,
    SandboxGone,
    SandboxServiceFailed,
    SandboxSetupError,
    SandboxStartError,
)
from .reaper import reap_finished_children, teardown
from .roots import default_root_dir, ensure_root
from .runtime.supervisor import remove_tree
from .sandbox_client import SandboxClient
from .supervisor_spawn import ForkServerUnavailable, spawn_direct, spawn_supervisor

log = logging.getLogger(__name__)


async def create_sandbox(
    spec: SandboxSpec,
    sandbox_id: str | None = None,
    owner: str = "",
    root_dir: str | None = None,
    ready_timeout_s: float = 120.0,
) -> SandboxHandle:
    """Start a sandbox and its supervisor; raises SandboxStartError / SandboxSetupError."""
    sandbox_id = sandbox_id or f"sb-{os.getpid()}-{time.monotonic_ns()}"
    if not re.match(SANDBOX_ID_PATTERN, sandbox_id):
        raise SandboxError(f"sandbox id {sandbox_id!r} must match {SANDBOX_ID_PATTERN} (e.g. the job id)")
    layout = SandboxLayout.of(root_dir or default_root_dir(), sandbox_id)
    backend = select_backend(spec)
    ensure_root(os.path.dirname(layout.dir))  # UnsafeSandboxRoot where another user could change it
    try:
        layout.make()
    except FileExistsError:
        raise SandboxError(
            f"a sandbox {sandbox_id!r} already exists in {layout.dir}; destroy it or pick another id"
        ) from None
    reap_finished_children()
    try:
        plan = backend.plan(spec, layout, sandbox_id, owner)
    except Exception:
        remove_tree(layout.dir)
        raise
    plan.created_at = time.time()
    if plan.start_timeout_s is not None:  # a start that waits for services: the supervisor reports after it
        ready_timeout_s = max(ready_timeout_s, plan.start_timeout_s + 30.0)
    write_plan(layout.plan_path, plan.to_json_dict())
    starting = asyncio.ensure_future(_start_supervisor(layout, sandbox_id, ready_timeout_s))
    try:
        line = await asyncio.shield(starting)
    except asyncio.CancelledError:
        # The caller was cancelled (its job was) while the supervisor started: let the start
        # finish, so its pid is known, then take the half-made sandbox down before giving up.
        await _shielded(_discard_started(starting, layout.dir))
        raise
    if not line.startswith("ok "):
        teardown(layout.dir)
        detail = line[len("error ") :] if line.startswith("error ") else "it exited before reporting ready"
        failed = SandboxServiceFailed if SERVICE_FAILED_MARK in detail else SandboxStartError
        raise failed(f"sandbox {sandbox_id} ({backend.name}) did not start: {detail.replace(SERVICE_FAILED_MARK, '')}")
    handle = SandboxHandle(
        id=sandbox_id,
        backend=backend.name,
        socket_path=layout.socket_path,
        supervisor_pid=int(line.split()[1]),
        workdir=plan.workdir_inner,
        owner=owner,
        created_at=plan.created_at,
        dir=layout.dir,
        host_workdir=layout.work,
    )
    if spec.files or spec.setup_commands:
        try:
            await _prepare(handle, spec)
        except BaseException:
            await _shielded(destroy_sandbox(handle))
            raise
    return handle


async def _start_supervisor(layout: SandboxLayout, sandbox_id: str, ready_timeout_s: float) -> str:
    try:
        return await spawn_supervisor(
            os.path.dirname(layout.dir), layout.plan_path, layout.log_path, layout.dir, ready_timeout_s
        )
    except ForkServerUnavailable as error:
        log.warning("%s; starting the supervisor of sandbox %s directly (slower)", error, sandbox_id)
        return await spawn_direct(layout.plan_path, layout.log_path, layout.dir, ready_timeout_s)


async def _discard_started(starting: asyncio.Future, directory: str) -> None:
    try:
        line = await starting
    except Exception:
        line = ""
    pid = int(line.split()[1]) if line.startswith("ok ") else None
    await asyncio.to_thread(teardown, directory, pid)


async def _shielded(cleanup) -> None:
    """Run a cleanup to its end even if the caller is cancelled again meanwhile (it then
    finishes in the background)."""
    task = asyncio.ensure_future(cleanup)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


async def _prepare(handle: SandboxHandle, spec: SandboxSpec) -> None:
    async with SandboxClient(handle.socket_path) as sandbox:
        for path, content in spec.files.items():
            await sandbox.write_file(path, content)
        for command in spec.setup_commands:
            result = await sandbox.bash(command, timeout_s=spec.setup_timeout_s, no_output_timeout_s=0, session="setup")
            if result.exit_code != 0:
                raise SandboxSetupError(
                    f"setup command {command!r} failed in sandbox {handle.id} (exit {result.exit_code}"
                    f"{', ' + result.note if result.note else ''}): {result.output[-2000:]}"
                )
        await sandbox.close_session("setup")


def checked_handle(handle: SandboxHandle | dict, root_dir: str | None = None) -> SandboxHandle:
    """The handle of sandbox `handle['id']` under `root_dir`, its paths rebuilt from the id.

    A handle read from a stream is data anyone with Redis access could have written: its
    folder and socket are never used as given (a forged one would point teardown's rm -rf or
    the tool client at a host path); one that does not match its id is refused.
    """
    if isinstance(handle, dict):
        handle = SandboxHandle.model_validate(handle)
    if not re.match(SANDBOX_ID_PATTERN, handle.id):
        raise SandboxError(f"sandbox id {handle.id!r} must match {SANDBOX_ID_PATTERN}; refusing this handle")
    layout = SandboxLayout.of(root_dir or default_root_dir(), handle.id)
    given = {"dir": handle.dir or layout.dir, "socket_path": handle.socket_path,
             "host_workdir": handle.host_workdir or layout.work}
    expected = {"dir": layout.dir, "socket_path": layout.socket_path, "host_workdir": layout.work}
    wrong = [f"{key}={given[key]!r} (expected {expected[key]!r})" for key in expected if
             os.path.normpath(given[key]) != expected[key]]
    if wrong:
        raise SandboxError(f"the handle of sandbox {handle.id} does not match its id under {layout.dir}: "
                           f"{', '.join(wrong)}; refusing to use it")
    return handle.model_copy(update=expected)


def reassign_owner(handle: SandboxHandle, owner: str) -> SandboxHandle:
    """Make ``owner`` (a job id) the owner the node's reaper asks about: a warm sandbox handed to
    a job (workers/warm_pool.py). The plan is replaced whole, never edited in place."""
    path = os.path.join(handle.dir, "plan.json")
    with open(path) as source:
        plan = json.load(source)
    plan["owner"] = owner
    fresh = f"{path}.{os.getpid()}.new"
    write_plan(fresh, plan)
    os.replace(fresh, path)
    return handle.model_copy(update={"owner": owner})


async def destroy_sandbox(handle: SandboxHandle | dict, timeout_s: float = 30.0) -> None:
    """Stop the supervisor, its container and every process it started; remove its folder.

    Idempotent, and works from any process of the node (not only the creator).
    """
    if isinstance(handle, dict):
        handle = SandboxHandle.model_validate(handle)
    try:
        client = await SandboxClient(handle.socket_path, connect_timeout_s=5).connect()
    except SandboxGone:
        client = None
    if client is not None:
        try:
            await asyncio.wait_for(client.request("shutdown"), timeout_s)
            # The supervisor closes our connection only by exiting, after its teardown.
            assert client._read_task is not None
            await asyncio.wait_for(asyncio.shield(client._read_task), timeout_s)
        except (TimeoutError, SandboxGone):
            log.warning("sandbox %s did not shut down cleanly; killing it", handle.id)
        finally:
            await client.close()
    directory = handle.dir or os.path.dirname(handle.socket_path)
    await asyncio.to_thread(teardown, directory, handle.supervisor_pid)
