"""Pieces every CLI command shares: settings from flags and env, and the Redis to use
(the one named by --redis/REDIS_URL, else a private embedded one)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console

from rollstream.config import Settings, load_settings
from rollstream.pipeline.connection import check_sync, redacted, sync_redis
from rollstream.pipeline.embedded import EmbeddedRedis

console = Console(stderr=True)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def settings_from(redis: str | None = None, namespace: str | None = None, data_dir: Path | None = None,
                  node: str | None = None) -> Settings:
    return load_settings(redis_url=redis, namespace=namespace, data_dir=data_dir, node=node)


@contextlib.contextmanager
def redis_for(settings: Settings, *, embedded_ok: bool = True) -> Iterator[str]:
    """Yield a Redis URL: the configured one (checked), or a private embedded server
    that is stopped on exit."""
    if settings.redis_url:
        check_sync(sync_redis(settings.redis_url), settings.redis_url)
        yield settings.redis_url
        return
    if not embedded_ok:
        raise SystemExit("set REDIS_URL or pass --redis (this command does not start its own Redis)")
    server = EmbeddedRedis(settings.data_dir / "redis")
    with server:
        console.print(f"[dim]embedded redis-server at {redacted(server.url)} (AOF in {server.data_dir})[/dim]")
        yield server.url
