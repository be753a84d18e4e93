"""``rollstream up``: everything on one machine in one command — Redis (embedded unless
one is named), the three worker pools, and a live status view until Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import typer
from rich.live import Live
from rich.markup import escape

from rollstream.cli.common import (
    console,
    data_dir_option,
    fail,
    namespace_option,
    redis_for,
    redis_option,
    settings_from,
)
from rollstream.cli.status_view import rate_sampler, render
from rollstream.workers.pool import WorkerPool, WorkerProcessExited


def up(redis: str | None = redis_option("Redis URL; default $REDIS_URL, else an embedded redis-server "
                                           "in the data folder (started here, or shared if one runs)."),
       namespace: str | None = namespace_option(),
       data_dir: Path | None = data_dir_option(),
       model_dir: Path | None = typer.Option(None, "--model-dir", help="Tokenizer folder of the served "
                                                "model, which run workers of LLM tasks (arith, math, code, swe) "
                                                "need; default $ROLLSTREAM_MODEL_DIR."),
       processes: int = typer.Option(1, help="Processes per stage."),
       concurrency: int = typer.Option(64, help="Jobs in flight per process."),
       quiet: bool = typer.Option(False, "--quiet", help="No live view; just run until SIGTERM.")):
    """Start Redis (embedded unless --redis/REDIS_URL) and the init, run and eval pools."""
    settings = settings_from(redis, namespace, data_dir)
    model_dir = model_dir or settings.model_dir
    if model_dir is not None and not (Path(model_dir) / "tokenizer_config.json").is_file():
        fail(f"--model-dir {model_dir} holds no tokenizer (tokenizer_config.json); build one with "
             "'rollstream arith-model DIR' or 'rollstream tiny-model DIR'")
    env = {"ROLLSTREAM_MODEL_DIR": str(Path(model_dir).resolve())} if model_dir else {}
    with redis_for(settings) as url:
        pool = WorkerPool(redis_url=url, namespace=settings.namespace, data_dir=settings.data_dir,
                          log_dir=settings.data_dir / "logs", env=env)
        pool.start_all(processes=processes, concurrency=concurrency)
        console.print(f"[bold]rollstream up[/bold]: REDIS_URL={url}  logs in {settings.data_dir / 'logs'}"
                      + ("" if model_dir else "  (no --model-dir: LLM tasks will fail; echo runs)"),
                      highlight=False, soft_wrap=True)
        stop = asyncio.Event()
        worker_died = False

        async def watch():
            nonlocal worker_died
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            gen = rate_sampler(url, settings.namespace)
            with Live(console=console, refresh_per_second=2, transient=quiet) as view:
                async for st, rate in gen:
                    if not quiet:
                        view.update(render(st, rate))
                    try:
                        pool.check_alive()
                    except WorkerProcessExited as exc:  # a stage without workers would strand its jobs
                        console.print(f"[red]{escape(str(exc))}[/red]", highlight=False, soft_wrap=True)
                        worker_died = True
                        break
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                        break
                    except TimeoutError:
                        pass
            await gen.aclose()

        try:
            asyncio.run(watch())
        finally:
            console.print("stopping workers (they finish or hand back their jobs)...")
            pool.stop(timeout_s=settings.shutdown_grace_s + 10)
        if worker_died:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(up)
