"""The demo's rollouts: arith groups, echo jobs and the shipped task files, submitted through
the Python client and collected with a live progress bar into a JSONL file."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.demo.training import ARITH_HIGH, TRAIN_AGENT, TRAIN_SAMPLING
from rollstream.messages import Result
from rollstream.tasks import arith
from rollstream.tasks.registry import available_tasks, shipped_task_sets


def demo_jobs(n_arith: int, group_size: int, seed: int) -> list[tuple[dict, int]]:
    """(job, group size) pairs: arith groups, echo jobs, and the shipped task files."""
    jobs: list[tuple[dict, int]] = []
    sampling = {"temperature": 1.0, "max_tokens": 64}
    agent = {"max_turns": 4, "max_tokens_per_turn": 64, "max_context_tokens": 2048, "max_wall_time_s": 120}
    for inst in arith.make_instances(max(1, n_arith // group_size), seed=seed, high=ARITH_HIGH):
        jobs.append(({"task": "arith", "instance": inst, "sampling": TRAIN_SAMPLING, "agent": TRAIN_AGENT},
                     group_size))
    jobs += [({"task": "echo", "instance": {"prompt": f"hello {i}"}}, 1) for i in range(4)]
    shipped = shipped_task_sets()
    for name in ("math", "code", "swe"):
        path = shipped.get(name)
        if name in available_tasks() and path is not None:
            for line in path.read_text().splitlines()[:2]:
                if line.strip():
                    job = json.loads(line)
                    job.setdefault("sampling", sampling)
                    job.setdefault("agent", agent)
                    jobs.append((job, 1))
    return jobs


async def run_rollouts(url: str, namespace: str, jobs: list[tuple[dict, int]], out: Path, timeout_s: float,
                       console: Console) -> tuple[list[Result], float, int]:
    """Submit ``jobs``, collect their results (until all came or none came for ``timeout_s``)
    into ``out``; (results, seconds, jobs submitted)."""
    total = sum(n for _job, n in jobs)
    results: list[Result] = []
    async with AsyncClient(settings=Settings(redis_url=url, namespace=namespace), submitter="demo") as client:
        t0 = time.monotonic()
        for job, n in jobs:
            if n > 1:
                await client.submit_group(job, n)
            else:
                await client.submit(job)
        with Progress(TextColumn("[bold]rollouts"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console) as progress:
            bar = progress.add_task("rollouts", total=total, detail="")
            async for res in client.results(timeout_s=timeout_s):
                results.append(res)
                rewards = [r.reward for r in results if r.reward is not None]
                detail = f"ok {sum(r.ok for r in results)}  reward {statistics.fmean(rewards):.2f}" if rewards else ""
                progress.update(bar, advance=1, detail=detail)
                if len(results) >= total:
                    break
        elapsed = time.monotonic() - t0
    with out.open("w") as fh:
        for res in results:
            fh.write(res.model_dump_json() + "\n")
    return results, elapsed, total
