"""``rollstream drain NODE``: take a node out of the fleet without losing its work. Its init
workers stop taking jobs at once, its run and eval workers finish what the node holds, and
what is left after the grace time goes back to init for other nodes (pipeline/drain.py)."""

from __future__ import annotations

import asyncio
import json
import time

import typer

from rollstream.cli.common import console, fail, namespace_option, redis_option, require_redis_url, settings_from
from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.drain import DrainStarted, node_workers, request_drain
from rollstream.pipeline.keys import Keys


async def _drain(url: str, namespace: str, node: str, grace_s: float, worker_ttl_s: float,
                 wait: bool) -> tuple[DrainStarted, list[str]]:
    r = async_redis(url)
    keys = Keys(namespace)
    try:
        started = await request_drain(r, keys, node, grace_s, worker_ttl_s=worker_ttl_s)
        left = started.workers
        if wait:
            # Workers notice within a heartbeat and hand back at the deadline; give them a
            # heartbeat's age past it to leave.
            until = started.deadline + worker_ttl_s
            while left and time.time() < until:
                await asyncio.sleep(0.5)
                left = await node_workers(r, keys, node, worker_ttl_s)
        return started, left
    finally:
        await r.aclose()


def drain(node: str = typer.Argument(..., help="The node's name (its workers' ROLLSTREAM_NODE)."),
          grace_s: float | None = typer.Option(None, "--grace-s", min=0, help="Seconds the node's workers may "
                                                  "finish their jobs before handing the rest back to init "
                                                  "(default: drain_grace_s, 60)."),
          wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the node's workers have left."),
          redis: str | None = redis_option(), namespace: str | None = namespace_option(),
          as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON.")):
    """Drain NODE: it takes no new init work, finishes or hands back what it holds within the
    grace time, and leaves the live list ('rollstream status' shows its workers as draining)."""
    settings = settings_from(redis, namespace)
    url = require_redis_url(settings, "drain")
    grace = settings.drain_grace_s if grace_s is None else grace_s
    try:
        started, left = asyncio.run(_drain(url, settings.namespace, node, grace,
                                           settings.worker_ttl_s, wait))
    except LookupError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps({**started.model_dump(), "left": wait and not left, "still_live": left}))
    elif not wait:
        console.print(f"node {node} drains: {len(started.workers)} workers let go of their jobs within {grace:g} s")
    elif left:
        console.print(f"node {node}: {len(left)} workers still live after the grace time: {', '.join(left)}")
    else:
        console.print(f"node {node} drained: its {len(started.workers)} workers left")
    if wait and left:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command()(drain)
