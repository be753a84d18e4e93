"""The demo's run: the built-in model server (or the given backend) registered with the
balancer, the three worker pools, the rollouts, then DAPO on arith through the same pools.
The caller brings the Redis (cli/demo.py: the configured one, else an embedded one)."""

from __future__ import annotations

import asyncio
import shutil
import uuid
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rollstream.demo.arith_model import ARITH_RL_RECIPE, cached_arith_model, model_cache, recipe_folder_name
from rollstream.demo.report import DemoOutcome, summarize
from rollstream.demo.rollouts import demo_jobs, run_rollouts
from rollstream.demo.training import train_briefly
from rollstream.llm.balancer import add_backend
from rollstream.pipeline.connection import async_redis
from rollstream.workers.pool import WorkerPool


def quiet_transformers() -> None:
    """No transformers progress bars: a bar per weight save would bury the demo's own output."""
    # transformers (the model extra) only when the demo starts: `rollstream --help` imports this module
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def local_model(console: Console) -> Path:
    """The tiny local model warmed up by ARITH_RL_RECIPE, from the model cache (built on the
    first run, with a progress bar; about two minutes on 2 cores)."""
    if (model_cache() / recipe_folder_name(ARITH_RL_RECIPE) / "config.json").exists():
        return cached_arith_model()
    console.print(f"building the local model into {model_cache()} (first run only): a tiny Qwen-style model "
                  "(1M parameters), warmed up on arith episodes that compute with bash")
    with Progress(TextColumn("[bold]warm-up"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("warm-up", total=ARITH_RL_RECIPE["steps"])
        return cached_arith_model(on_step=lambda done, _total: progress.update(bar, completed=done))


async def _register_backend(url: str, backend: str, namespace: str) -> None:
    r = async_redis(url)
    await add_backend(r, backend, namespace)
    await r.aclose()


def run_demo(url: str, model_dir: Path, root: Path, console: Console, *, backend: str | None, jobs: int,
             group_size: int, concurrency: int, seed: int, train_steps: int, timeout_s: float) -> DemoOutcome:
    """Rollouts across the built-in tasks through pools on ``url`` (files under ``root``),
    then ``train_steps`` DAPO steps when the model is served by the built-in server."""
    # the built-in server's module imports torch (the model extra): not at `rollstream --help`
    from rollstream.llm.server.app import start_server_process

    namespace = f"demo{uuid.uuid4().hex[:6]}"
    server = None
    try:
        if backend is None:
            server, backend = start_server_process(model_dir, device="auto")
            console.print(f"built-in model server at {backend} serving {model_dir}")
        asyncio.run(_register_backend(url, backend, namespace))
        pool = WorkerPool(redis_url=url, namespace=namespace, data_dir=root, log_dir=root / "logs",
                          env={"ROLLSTREAM_MODEL_DIR": str(model_dir), "OMP_NUM_THREADS": "1"})
        pool.start_all(concurrency=concurrency)
        try:
            plan = demo_jobs(jobs, group_size, seed)
            out = root / "trajectories.jsonl"
            results, elapsed, total = asyncio.run(run_rollouts(url, namespace, plan, out, timeout_s, console))
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
    return DemoOutcome(results=results, elapsed_s=elapsed, total=total, trained=trained, trajectories=out,
                       logs=root / "logs")
