"""``rollstream backends add|list|remove|pause|resume``: the inference servers in the balancer,
and generation paused across them (around a weight sync)."""

from __future__ import annotations

import asyncio
import json

import typer
from rich.table import Table

from rollstream.cli.common import console, namespace_option, redis_option, require_redis, settings_from
from rollstream.llm.balancer import Balancer, add_backend, list_backends, normalize_url, remove_backend
from rollstream.pipeline.connection import async_redis

app = typer.Typer(help="Inference servers (vLLM, SGLang, built-in) the run workers balance over.",
                  no_args_is_help=True)


def _run(coro_fn, redis: str | None, namespace: str | None):
    settings = require_redis(settings_from(redis, namespace), "backends")

    async def go():
        r = async_redis(settings.redis_url)
        try:
            return await coro_fn(r, settings.namespace)
        finally:
            await r.aclose()

    return asyncio.run(go())


def _check(url: str) -> None:
    try:
        normalize_url(url)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


@app.command()
def add(url: str = typer.Argument(..., help="Base URL, e.g. http://gpu1:8000"),
        redis: str | None = redis_option(), namespace: str | None = namespace_option()):
    """Register a backend (idempotent)."""
    _check(url)
    new = _run(lambda r, ns: add_backend(r, url, ns), redis, namespace)
    console.print(f"{'added' if new else 'already registered'}: {url}")


@app.command("list")
def list_(redis: str | None = redis_option(), namespace: str | None = namespace_option(),
          as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts.")):
    """Backends with their in-flight requests and health."""
    rows = _run(list_backends, redis, namespace)
    if as_json:
        print(json.dumps([row.model_dump() for row in rows]))
        return
    table = Table("backend", "in flight", "healthy", "policy")
    for row in rows:
        # the version the trainer's last weight sync left it serving (weight_sync.record_served_versions)
        policy = str(row.info.get("policy_version", "-"))
        if row.info.get("policy_sync_error"):
            policy += " [red](last sync failed)[/red]"
        table.add_row(row.url, str(row.in_flight), "yes" if row.healthy else "[red]no[/red]", policy)
    console.print(table)


@app.command()
def remove(url: str = typer.Argument(..., help="Base URL as registered."),
           redis: str | None = redis_option(), namespace: str | None = namespace_option()):
    """Remove a backend; run workers stop sending it new turns."""
    _check(url)
    if not _run(lambda r, ns: remove_backend(r, url, ns), redis, namespace):
        raise SystemExit(f"no backend {url}")  # on stderr, exit status 1
    console.print(f"removed: {url}")


@app.command()
def pause(reason: str = typer.Option("paused by the operator", help="Why; shown by 'backends paused'."),
          ttl_s: float = typer.Option(600.0, help="The pause ends by itself after this long (a forgotten one "
                                                  "never stops training for good)."),
          drain_timeout_s: float = typer.Option(120.0, help="How long the turns in flight may take to finish."),
          redis: str | None = redis_option(), namespace: str | None = namespace_option()):
    """Pause generation on every backend: no new model turn starts; returns once the turns in
    flight have finished (what a weight sync does around loading, by itself)."""
    drained_s = _run(lambda r, ns: Balancer(r, namespace=ns).pause(reason, ttl_s=ttl_s,
                                                                   drain_timeout_s=drain_timeout_s), redis, namespace)
    console.print(f"generation paused ({reason}); turns in flight finished in {drained_s:.2f} s; "
                  f"'rollstream backends resume' ends it (or it ends by itself in {ttl_s:.0f} s)")


@app.command()
def resume(redis: str | None = redis_option(), namespace: str | None = namespace_option()):
    """Resume generation after 'backends pause'."""
    resumed = _run(lambda r, ns: Balancer(r, namespace=ns).resume(), redis, namespace)
    console.print("generation resumed" if resumed else "generation was not paused")
