"""``rollstream submit`` and ``rollstream cancel``: a task file (or a task set shipped with
rollstream, by name) into the init stream, its results back with a live progress line, and
cancellation of a job, a group, a submitter or everything."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import cast

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollstream.cli.common import (
    console,
    fail,
    namespace_option,
    redis_option,
    require_redis,
    require_redis_url,
    settings_from,
)
from rollstream.client import AsyncClient
from rollstream.errors import InvalidJob, JobFailed, RedisUnavailable
from rollstream.messages import Result
from rollstream.pipeline import cancel as cancel_flags
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys
from rollstream.tasks.harbor_folder import task_folders
from rollstream.tasks.nemo_gym_env import task_set as nemo_gym_task_set
from rollstream.tasks.openenv_env import task_set as openenv_task_set
from rollstream.tasks.registry import shipped_task_sets
from rollstream.tasks.verifiers_env import task_set as verifiers_task_set

EXIT_FAILED = 1  # some job failed or was cancelled
EXIT_TIMEOUT = 3  # the deadline passed before every result came


def task_file(spec: str) -> Path:
    """A path to a JSONL file, or the name of a shipped task set."""
    path = Path(spec)
    if path.is_file():
        return path
    shipped = shipped_task_sets()
    if spec in shipped:
        return shipped[spec]
    fail(f"no file {spec!r} and no shipped task set of that name; shipped: {', '.join(sorted(shipped))}")


def read_jobs(path: Path) -> list[tuple[int, dict]]:
    """(line number, job) for every non-blank line; a bad line ends the command naming it."""
    jobs = []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {path}: {exc}")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except json.JSONDecodeError as exc:
            fail(f"{path}:{number}: not JSON ({exc.msg} at column {exc.colno})")
        if not isinstance(job, dict):
            fail(f"{path}:{number}: a job is a JSON object like {{\"task\": \"echo\", \"instance\": {{...}}}}")
        jobs.append((number, job))
    if not jobs:
        fail(f"{path} holds no jobs (one JSON object per line)")
    return jobs


def harbor_jobs(spec: str) -> tuple[Path, list[tuple[int, dict]]] | None:
    """Jobs of the harbor task when ``spec`` names a Harbor task folder, a folder of them or a
    dataset file naming them (tasks/harbor_folder.py); None for anything else."""
    try:
        folders = task_folders(Path(spec))
    except (InvalidJob, OSError, ValueError) as exc:
        fail(str(exc))
    if folders is None:
        return None
    return Path(spec), [(n, {"task": "harbor", "instance": {"path": str(folder)},
                             "metadata": {"harbor_task": folder.name}}) for n, folder in enumerate(folders, 1)]


def verifiers_jobs(spec: str) -> tuple[Path, list[tuple[int, dict]]] | None:
    """Jobs of the verifiers task when ``spec`` is ``verifiers:ENV_ID[:ARGS]``: one per dataset row;
    of the openenv task when it is ``openenv:PATH[:FIELDS]``: one, or one per reset seed; of the nemo-gym
    task when it is ``nemo-gym:SERVER:DATASET.jsonl``: one per row."""
    try:
        found = verifiers_task_set(spec) or openenv_task_set(spec) or nemo_gym_task_set(spec)
    except (InvalidJob, JobFailed) as exc:
        fail(str(exc))
    return None if found is None else (Path(spec), list(enumerate(found, 1)))


class Tally:
    """Counts of the results so far, for the progress line and the exit status."""

    def __init__(self, total: int):
        self.total = total
        self.by_status = {"completed": 0, "failed": 0, "cancelled": 0}
        self.rewards: list[float] = []
        self.first_error: str | None = None

    def add(self, result: Result) -> None:
        self.by_status[result.status] = self.by_status.get(result.status, 0) + 1
        if result.reward is not None and result.ok:
            self.rewards.append(result.reward)
        if result.status == "failed" and self.first_error is None:
            self.first_error = result.error

    @property
    def finished(self) -> int:
        return sum(self.by_status.values())

    def line(self) -> str:
        mean = f"{sum(self.rewards) / len(self.rewards):.2f}" if self.rewards else "-"
        return (f"done {self.by_status['completed']}  failed {self.by_status['failed']}  "
                f"cancelled {self.by_status['cancelled']}  in flight {self.total - self.finished}  "
                f"mean reward {mean}")


def submit(
    tasks: str = typer.Argument(..., help="A JSONL file, one job per line ({\"task\": ..., \"instance\": {...}}), "
                                "the name of a task set shipped with rollstream (arith, code, echo, math, swe), or "
                                "Harbor task folders: a folder, a folder of them, or a dataset file naming them "
                                "(.txt, one path a line; or a Harbor registry .json with local paths), or "
                                "verifiers:ENV_ID[:JSON-ARGS], one job per row of a verifiers environment's dataset, "
                                "or openenv:PATH[:JSON-FIELDS], an OpenEnv environment folder (one job, or one per "
                                "reset seed of \"seeds\": [...]), or nemo-gym:SERVER:DATASET.jsonl, one job per "
                                "row of a NeMo Gym resources server's dataset."),
    redis: str | None = redis_option(), namespace: str | None = namespace_option(),
    group_size: int = typer.Option(1, "--group-size", "-n", min=1, help="Submit each line as a group of N jobs."),
    wait: bool = typer.Option(False, "--wait", help="Show progress, print each result as a JSON line as it "
                              "arrives; exit 1 if any job failed or was cancelled."),
    submitter: str | None = typer.Option(None, "--submitter", help="Results stream name (default: random)."),
    timeout_s: float = typer.Option(600.0, "--timeout-s", help="With --wait: the deadline, in seconds from "
                                    "submission, for all results (exit 3 past it; the jobs keep running)."),
    priority: int | None = typer.Option(None, "--priority", min=0, max=100, help="0-100, higher first "
                                           "(default: a line's own \"priority\", else 50); queued jobs are "
                                           "served by queue time + (100 - priority) * ROLLSTREAM_PRIORITY_AGING_S, "
                                           "so none starves."),
) -> None:
    """Submit a task file; prints the job ids, or with --wait the results."""
    harbor = verifiers_jobs(tasks) or harbor_jobs(tasks)
    path, jobs = harbor if harbor is not None else (task_file(tasks), [])
    jobs = jobs or read_jobs(path)
    if priority is not None:
        jobs = [(number, {**job, "priority": priority}) for number, job in jobs]
    settings = require_redis(settings_from(redis, namespace), "submit")

    async def go() -> int:
        async with AsyncClient(settings=settings, submitter=submitter) as client:
            ids: list[str] = []
            for number, job in jobs:
                try:
                    if group_size > 1:
                        ids += (await client.submit_group(job, group_size))[1]
                    else:
                        ids.append(await client.submit(job))
                except InvalidJob as exc:
                    done = f"the {len(ids)} jobs of the lines before were submitted" if ids else "nothing was submitted"
                    fail(f"{path}:{number}: {exc} ({done})")
            console.print(f"submitted {len(ids)} jobs from {path} as submitter '{client.submitter}'",
                          highlight=False)
            if not wait:
                print("\n".join(ids))
                return 0
            return await follow(client, len(ids), timeout_s)

    try:
        code = asyncio.run(go())
    except RedisUnavailable as exc:
        fail(str(exc))
    raise typer.Exit(code)


def cancel(
    job: str | None = typer.Option(None, "--job", help="Cancel this job id."),
    group: str | None = typer.Option(None, "--group", help="Cancel every job of this group id."),
    submitter: str | None = typer.Option(None, "--submitter", help="Cancel every job this submitter "
                                            "has queued or running."),
    everything: bool = typer.Option(False, "--all", help="Cancel every job of every submitter in the "
                                    "namespace."),
    redis: str | None = redis_option(), namespace: str | None = namespace_option(),
) -> None:
    """Cancel jobs; each cancelled job still yields one result, with status 'cancelled'."""
    if not (job or group or submitter or everything):
        fail("say what to cancel: --job ID, --group ID, --submitter NAME or --all")
    settings = settings_from(redis, namespace)
    url = require_redis_url(settings, "cancel")
    keys = Keys(settings.namespace)

    async def go() -> list[str]:
        r = async_redis(url)
        try:
            submitters = [submitter] if submitter else []
            if everything:  # raw XADD jobs belong to 'default'
                found = [s.decode() for s in cast(list[bytes], await r.zrange(keys.submitters, 0, -1))]
                submitters = sorted({*found, "default"})
            if job or group:
                await cancel_flags.cancel(r, keys, job_id=job, group_id=group, ttl_s=settings.job_state_ttl_s)
            for name in submitters:
                await cancel_flags.cancel(r, keys, submitter=name, ttl_s=settings.job_state_ttl_s)
            return submitters
        finally:
            await r.aclose()

    try:
        submitters = asyncio.run(go())
    except RedisUnavailable as exc:
        fail(str(exc))
    what = [f"job {job}"] * bool(job) + [f"group {group}"] * bool(group)
    what += [f"submitter {s}" for s in submitters]
    console.print(f"cancelled: {', '.join(what)}", highlight=False)


async def follow(client, total: int, timeout_s: float) -> int:
    """Print results as they come, with a progress line on stderr, until all are in or the
    deadline passes; returns the exit status."""
    tally = Tally(total)
    deadline = time.monotonic() + timeout_s
    progress = Progress(BarColumn(bar_width=12), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=console, transient=False)
    with progress:
        bar = progress.add_task(tally.line(), total=total)
        while tally.finished < total:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Short slices, so the deadline holds however results trickle in.
            async for result in client.results(timeout_s=min(left, 1.0), max_results=total - tally.finished):
                tally.add(result)
                sys.stdout.write(result.model_dump_json() + "\n")
                sys.stdout.flush()
                progress.update(bar, completed=tally.finished, description=tally.line())
    console.print(tally.line(), highlight=False)
    if tally.finished < total:
        console.print(f"[red]timed out[/red] after {timeout_s:g} s with {tally.finished} of {total} results; the "
                      f"rest are still queued or running ('rollstream cancel --submitter {client.submitter}')",
                      highlight=False)
        return EXIT_TIMEOUT
    bad = tally.by_status["failed"] + tally.by_status["cancelled"]
    if bad:
        why = f"; first error: {tally.first_error}" if tally.first_error else ""
        console.print(f"[red]{bad} of {total} jobs did not complete[/red]{why}", highlight=False, soft_wrap=True)
        return EXIT_FAILED
    return 0


def register(app: typer.Typer) -> None:
    app.command()(submit)
    app.command()(cancel)
