"""``rollstream demo``: the whole system on one machine with nothing to configure — the
embedded Redis, the built-in model server with a small local model (warmed up on the arith
task, built on first use and cached), the three pools, a few dozen rollouts across the
built-in tasks with a live progress view, a summary table that says what each row shows,
trajectories in a JSONL file, then DAPO on arith through the same pools, with weight sync
after every step, and the reward curve in the terminal and a PNG."""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollstream.cli.common import console, redis_for, settings_from
from rollstream.messages import Result

DATA_TASKS = Path(__file__).resolve().parent.parent / "data" / "tasks"

# bench/arith_rl.py's settings, which learn on 2 cores (0.23 -> 0.88 in 15 steps): the
# ARITH_RL_RECIPE model, one-digit sums (what it was warmed up on), 4 groups of 8 per step.
ARITH_HIGH = 5
TRAIN_SAMPLING = {"temperature": 1.0, "max_tokens": 40}
TRAIN_AGENT = {"max_turns": 2, "max_tokens_per_turn": 40, "max_context_tokens": 1024, "max_wall_time_s": 120}

# What each row of the rollouts table shows, since a 1M-parameter model scores 0 on most tasks.
ROW_MEANING = {
    "arith": "sums with a bash tool: the task trained below (before training the model names "
             "submit's argument right ~1 time in 4)",
    "echo": "no model: the pipeline alone (reward 1 = the job went through every stage)",
    "math": "a math question the tiny model cannot answer: reward 0 is expected; shows sandbox, turns, scoring",
    "code": "write a function, scored by running tests in the sandbox: reward 0 is expected from the tiny model",
    "swe": "fix a repository, scored by its test suite: reward 0 is expected from the tiny model",
}


def demo_jobs(n_arith: int, group_size: int, seed: int) -> list[tuple[dict, int]]:
    """(job, group size) pairs: arith groups, echo jobs, and the shipped task files."""
    from rollstream.tasks import arith
    from rollstream.tasks.registry import available_tasks

    jobs: list[tuple[dict, int]] = []
    sampling = {"temperature": 1.0, "max_tokens": 64}
    agent = {"max_turns": 4, "max_tokens_per_turn": 64, "max_context_tokens": 2048, "max_wall_time_s": 120}
    for inst in arith.make_instances(max(1, n_arith // group_size), seed=seed, high=ARITH_HIGH):
        jobs.append(({"task": "arith", "instance": inst, "sampling": TRAIN_SAMPLING, "agent": TRAIN_AGENT},
                     group_size))
    jobs += [({"task": "echo", "instance": {"prompt": f"hello {i}"}}, 1) for i in range(4)]
    for name in ("math", "code", "swe"):
        path = DATA_TASKS / f"{name}.jsonl"
        if name in available_tasks() and path.exists():
            for line in path.read_text().splitlines()[:2]:
                if line.strip():
                    job = json.loads(line)
                    job.setdefault("sampling", sampling)
                    job.setdefault("agent", agent)
                    jobs.append((job, 1))
    return jobs


def train_briefly(url: str, namespace: str, model_dir: Path, root: Path, steps: int, seed: int):
    """DAPO steps on arith: groups through the running pools, each update published to the
    built-in server (the backends registered in Redis) before the next step's rollouts."""
    import torch

    from rollstream.tasks import arith
    from rollstream.trainer import TrainConfig, train

    # one intra-op thread: the server and the pools share the cores (bench/arith_rl.py)
    torch.set_num_threads(1)
    prompts = root / "train-prompts.jsonl"
    prompts.write_text("".join(json.dumps(inst) + "\n"
                               for inst in arith.make_instances(500, seed=seed + 123, high=ARITH_HIGH)))
    config = TrainConfig(
        model_dir=model_dir, task="arith", prompts_file=prompts, output_dir=root / "train", steps=steps, seed=seed,
        device="cpu", redis_url=url, namespace=namespace, submitter="demo-trainer", resume=False,
        sampling=TRAIN_SAMPLING, agent=TRAIN_AGENT,
        sampler={"groups_per_batch": 4, "group_size": 8, "result_timeout_s": 240},
        optim={"lr": 2e-4, "micro_batch_size": 16}, checkpoint_every_steps=steps, progress=True)
    return train(config)


def reward_curve_table(metrics_path: Path) -> Table:
    """The reward per training step as a bar chart in the terminal."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    table = Table(title="reward per DAPO step (mean over every rollout of the step)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("step", "reward", "", "kept groups", "step s"):
        table.add_column(col, justify="left" if col == "" else "right")
    for row in rows:
        reward = row.get("reward_mean_all") or 0.0
        table.add_row(str(row["step"]), f"{reward:.2f}", "█" * round(40 * reward) or "·",
                      f"{row.get('groups_kept', '-')}", f"{row.get('step_s', 0):.1f}")
    return table


def local_model() -> Path:
    """The tiny local model warmed up by ARITH_RL_RECIPE, from the model cache (built on the
    first run, with a progress bar; about two minutes on 2 cores)."""
    from rollstream.llm.format_pretrain import ARITH_RL_RECIPE, cached_arith_model, model_cache, recipe_folder_name

    if (model_cache() / recipe_folder_name(ARITH_RL_RECIPE) / "config.json").exists():
        return cached_arith_model()
    console.print(f"building the local model into {model_cache()} (first run only): a tiny Qwen-style model "
                  "(1M parameters), warmed up on arith episodes that compute with bash")
    with Progress(TextColumn("[bold]warm-up"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("warm-up", total=ARITH_RL_RECIPE["steps"])
        return cached_arith_model(on_step=lambda done, _total: progress.update(bar, completed=done))


def summarize(results: list[Result], elapsed_s: float) -> Table:
    by_task: dict[str, list[Result]] = defaultdict(list)
    for res in results:
        by_task[res.task].append(res)
    table = Table(title=f"{len(results)} rollouts in {elapsed_s:.1f} s = {len(results) / elapsed_s:.2f} jobs/s",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("task", "jobs", "ok", "fail", "reward", "init s", "run s", "eval s", "turns",
                "tools", "tool ms"):
        table.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)

    def mean(xs):
        return f"{statistics.fmean(xs):.2f}" if xs else "-"

    for task, rs in sorted(by_task.items()):
        ok = [r for r in rs if r.status == "completed"]
        tools = [c.duration_ms for r in ok if r.trajectory for c in r.trajectory.tool_calls if c.duration_ms > 0]
        table.add_row(task, str(len(rs)), str(len(ok)), str(len(rs) - len(ok)),
                      mean([r.reward for r in ok if r.reward is not None]),
                      mean([r.timings_s.get("init_s", 0) for r in ok]), mean([r.timings_s.get("run_s", 0) for r in ok]),
                      mean([r.timings_s.get("eval_s", 0) for r in ok]),
                      mean([r.trajectory.num_turns for r in ok if r.trajectory]), str(len(tools)),
                      f"{statistics.median(tools):.1f}" if tools else "-")
    table.caption = "\n".join(f"{task}: {ROW_MEANING[task]}" for task in sorted(by_task) if task in ROW_MEANING)
    table.caption_justify = "left"
    return table


async def _run(url: str, namespace: str, jobs: list[tuple[dict, int]], out: Path, timeout_s: float):
    from rollstream.client import AsyncClient
    from rollstream.config import Settings

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


def register(app: typer.Typer) -> None:
    @app.command()
    def demo(backend: Optional[str] = typer.Option(None, "--backend", help="Use this OpenAI-compatible server "
                                                   "(e.g. vLLM) instead of the built-in one; needs --model-dir."),
             model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="Tokenizer (and, for the built-in "
                                                      "server, weights) of the model; default: the local tiny model."),
             data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Where the embedded Redis, logs, "
                                                     "trajectories and the training run go (default: the data dir)."),
             jobs: int = typer.Option(16, help="Arith rollouts (in groups of --group-size) before training."),
             group_size: int = typer.Option(4, help="Rollouts per arith prompt before training."),
             concurrency: int = typer.Option(32, help="Jobs in flight per worker process."),
             seed: int = typer.Option(0, help="Seed of the task instances and of training."),
             train_steps: int = typer.Option(12, help="DAPO steps on arith after the rollouts, 4 groups of 8 "
                                             "rollouts each (0 = none)."),
             timeout_s: float = typer.Option(240.0, help="Give up when no result came for this long.")):
        """Run the whole system end to end on this machine and print a summary."""
        from transformers.utils import logging as hf_logging

        from rollstream.llm.server.app import start_server_process
        from rollstream.pipeline.balancer import add_backend
        from rollstream.pipeline.connection import async_redis
        from rollstream.workers.pool import WorkerPool

        hf_logging.disable_progress_bar()  # a bar per weight save would bury the demo's own output
        settings = settings_from(data_dir=data_dir)
        root = settings.data_dir / "demo"
        if backend and not model_dir:
            raise typer.BadParameter("--backend needs --model-dir (the served model's tokenizer folder)")
        started = time.monotonic()
        if model_dir is None:
            model_dir = local_model()
        namespace = f"demo{uuid.uuid4().hex[:6]}"
        server = None
        with redis_for(settings) as url:
            try:
                if backend is None:
                    server, backend = start_server_process(model_dir, device="auto")
                    console.print(f"built-in model server at {backend} serving {model_dir}")

                async def register_backend():
                    r = async_redis(url)
                    await add_backend(r, backend, namespace)
                    await r.aclose()

                asyncio.run(register_backend())
                pool = WorkerPool(redis_url=url, namespace=namespace, data_dir=root, log_dir=root / "logs",
                                  env={"ROLLSTREAM_MODEL_DIR": str(model_dir), "OMP_NUM_THREADS": "1"})
                pool.start_all(concurrency=concurrency)
                try:
                    plan = demo_jobs(jobs, group_size, seed)
                    out = root / "trajectories.jsonl"
                    results, elapsed, total = asyncio.run(_run(url, namespace, plan, out, timeout_s))
                    console.print(summarize(results, elapsed))
                    trained = None
                    if train_steps and server is not None:  # weights go to the built-in server only
                        console.print(f"[bold]training[/bold]: {train_steps} DAPO steps on arith through the same "
                                      "pools, 4 prompts × 8 rollouts a step, new weights served after each")
                        shutil.rmtree(root / "train", ignore_errors=True)  # the last demo's run
                        trained = train_briefly(url, namespace, model_dir, root, train_steps, seed)
                finally:
                    pool.stop(timeout_s=30)
            finally:
                if server is not None:
                    server.terminate()
                    server.wait(30)
        if trained is not None:
            console.print(reward_curve_table(trained.metrics_path))
            first, last = (f"{x:.2f}" if x is not None else "-" for x in (trained.reward_first, trained.reward_last))
            console.print(f"trained {trained.steps_done} steps: mean reward {first} → {last}, "
                          f"policy version {trained.policy_version}; metrics {trained.metrics_path}"
                          + (f", curve {trained.reward_curve}" if trained.reward_curve else ""))
        tools = [c.duration_ms for r in results if r.trajectory for c in r.trajectory.tool_calls if c.duration_ms > 0]
        if tools:
            console.print(f"tool-call latency: p50 {statistics.median(tools):.2f} ms, "
                          f"max {max(tools):.2f} ms over {len(tools)} calls")
        console.print(f"trajectories: {out}   worker logs: {root / 'logs'}")
        console.print(f"demo done in {time.monotonic() - started:.0f} s")
        if len(results) < total:
            raise typer.Exit(f"only {len(results)} of {total} rollouts came back; see the worker logs")
