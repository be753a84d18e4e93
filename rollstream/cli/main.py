"""The ``rollstream`` command: start everything, start one pool, submit a task file, watch
the queues. Sub-apps of other packages (backends, sandboxes, model server, trainer) are
attached here when their packages are importable."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.live import Live

from rollstream.cli.common import console, settings_from, setup_logging
from rollstream.cli.status_view import render
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.keys import Keys
from rollstream.pipeline.status import finished_total, snapshot

app = typer.Typer(help="rollstream: rollout-as-a-service for RL of multi-turn LLM agents.",
                  no_args_is_help=True, add_completion=False)

RedisOpt = typer.Option(None, "--redis", help="Redis URL (else $REDIS_URL, else an embedded redis-server).")
NsOpt = typer.Option(None, "--namespace", help="Key prefix (default rs).")
DataOpt = typer.Option(None, "--data-dir", help="Folder for the embedded Redis and work files.")


@app.command()
def redis(data_dir: Optional[Path] = DataOpt, port: int = typer.Option(0, help="Also listen on this "
                                                                              "TCP port on 127.0.0.1 (0 = unix socket only).")):
    """Start the embedded redis-server alone (AOF on) and wait; prints its URL."""
    from rollstream.pipeline.embedded import EmbeddedRedis

    settings = settings_from(data_dir=data_dir)
    server = EmbeddedRedis(settings.data_dir / "redis", port=port).start()
    print(server.url, flush=True)
    try:
        while server.proc is None or server.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@app.command()
def worker(stage: str = typer.Argument(..., help="init, run or eval"),
           concurrency: int = typer.Option(64, help="Jobs in flight in this process."),
           redis: Optional[str] = RedisOpt, namespace: Optional[str] = NsOpt, data_dir: Optional[Path] = DataOpt,
           node: Optional[str] = typer.Option(None, help="Node name (default: host name)."),
           model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="Tokenizer folder of the served "
                                                    "model (run workers of LLM tasks)."),
           verbose: bool = typer.Option(False, "-v")):
    """Run one stage's worker process (asyncio, CONCURRENCY jobs in flight) until SIGTERM."""
    from rollstream.workers.process import run_worker

    setup_logging(verbose)
    settings = settings_from(redis, namespace, data_dir, node)
    if model_dir:
        settings = settings.model_copy(update={"model_dir": model_dir})
    if not settings.redis_url:
        raise typer.BadParameter("a worker needs --redis or REDIS_URL (use 'rollstream up' for everything at once)")
    run_worker(stage, settings, concurrency)


async def _rate_sampler(url: str, namespace: str):
    r = async_redis(url)
    keys = Keys(namespace)
    last = None
    try:
        while True:
            st = await snapshot(r, keys)
            now, done = time.monotonic(), finished_total(st)
            rate = None if last is None else (done - last[1]) / max(now - last[0], 1e-6)
            last = (now, done)
            yield st, rate
    finally:
        await r.aclose()


@app.command()
def status(redis: Optional[str] = RedisOpt, namespace: Optional[str] = NsOpt,
           as_json: bool = typer.Option(False, "--json", help="Print one JSON snapshot."),
           watch: bool = typer.Option(False, "--watch", help="Redraw every second until Ctrl-C.")):
    """Streams, pending messages, consumers, workers, throughput and dead letters."""
    settings = settings_from(redis, namespace)
    if not settings.redis_url:
        raise typer.BadParameter("status needs --redis or REDIS_URL")

    async def once():
        gen = _rate_sampler(settings.redis_url, settings.namespace)
        st, _ = await gen.__anext__()
        await asyncio.sleep(1.0)
        st, rate = await gen.__anext__()
        await gen.aclose()
        return st, rate

    async def live():
        gen = _rate_sampler(settings.redis_url, settings.namespace)
        with Live(console=console, refresh_per_second=2) as view:
            async for st, rate in gen:
                view.update(render(st, rate))
                await asyncio.sleep(1.0)

    if watch:
        try:
            asyncio.run(live())
        except KeyboardInterrupt:
            pass
        return
    st, rate = asyncio.run(once())
    if as_json:
        print(json.dumps({**st.model_dump(), "jobs_per_s": rate}))
    else:
        console.print(render(st, rate))


@app.command()
def submit(file: Path = typer.Argument(..., help="JSONL: one job per line ({\"task\":..., \"instance\":{...}})."),
           redis: Optional[str] = RedisOpt, namespace: Optional[str] = NsOpt,
           group_size: int = typer.Option(1, "--group-size", "-n", help="Submit each line as a group of N."),
           wait: bool = typer.Option(False, help="Wait for every result and print them as JSONL."),
           submitter: Optional[str] = typer.Option(None, help="Results stream name (default: random)."),
           timeout_s: float = typer.Option(600.0, help="With --wait, give up after this long.")):
    """Submit a task file; prints job ids (or, with --wait, the results)."""
    from rollstream.client import AsyncClient

    settings = settings_from(redis, namespace)
    if not settings.redis_url:
        raise typer.BadParameter("submit needs --redis or REDIS_URL")
    lines = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]

    async def go():
        async with AsyncClient(settings=settings, submitter=submitter) as client:
            n = 0
            for job in lines:
                if group_size > 1:
                    _gid, ids = await client.submit_group(job, group_size)
                else:
                    ids = [await client.submit(job)]
                n += len(ids)
                if not wait:
                    for job_id in ids:
                        print(job_id)
            console.print(f"submitted {n} jobs as submitter '{client.submitter}'")
            if wait:
                for result in await client.collect(n, timeout_s=timeout_s):
                    sys.stdout.write(result.model_dump_json() + "\n")

    asyncio.run(go())


def _attach_optional_apps() -> None:
    """Sub-commands that live with their packages."""
    import importlib

    for module, name, attr in (("rollstream.cli.up", None, "register"),
                               ("rollstream.cli.demo", None, "register"),
                               ("rollstream.cli.backends", "backends", "app"),
                               ("rollstream.sandboxes.cli", "images", "app"),
                               ("rollstream.sandboxes.cli", "sandboxes", "sandboxes_app"),
                               ("rollstream.llm.cli", None, "register"),
                               ("rollstream.trainer.cli", None, "register"),
                               ("rollstream.api.cli", None, "register")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a broken optional module must not hide silently
                raise
            continue
        obj = getattr(mod, attr, None)
        if obj is None:
            continue
        if name:
            app.add_typer(obj, name=name)
        else:
            obj(app)


_attach_optional_apps()


def main() -> None:
    app()
