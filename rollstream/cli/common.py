"""Pieces every CLI command shares: settings from flags and env, the options every command
spells the same way, and the Redis to use (--redis, else $REDIS_URL, else the embedded one
that `rollstream up` runs in the data folder, else — for `up` and `demo` — a new one)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from rollstream.config import Settings, load_settings
from rollstream.pipeline.connection import check_sync, redacted, sync_redis
from rollstream.pipeline.embedded import EmbeddedRedis, embedded_dir, running_url

console = Console(stderr=True)

REDIS_HELP = ("Redis URL (redis://, rediss://, unix://); default $REDIS_URL, else the embedded Redis "
              "that 'rollstream up' runs in the data folder.")
NAMESPACE_HELP = "Prefix of every Redis key; default $ROLLSTREAM_NAMESPACE, else rs."
DATA_DIR_HELP = ("Folder of the embedded Redis (AOF), logs and the API token; default $ROLLSTREAM_DATA_DIR, "
                 "else ~/.local/share/rollstream.")


def redis_option(help: str = REDIS_HELP):
    return typer.Option(None, "--redis", help=help)


def redis_url_alias():
    """`--redis-url`, the old spelling, still taken (deployment files may use it) but not shown."""
    return typer.Option(None, "--redis-url", hidden=True)


def namespace_option():
    return typer.Option(None, "--namespace", help=NAMESPACE_HELP)


def data_dir_option():
    return typer.Option(None, "--data-dir", help=DATA_DIR_HELP)


def verbose_option():
    return typer.Option(False, "--verbose", "-v", help="Debug logging.")


def fail(message: str, code: int = 2) -> NoReturn:
    """End a command with one line on stderr, no traceback."""
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def settings_from(redis: str | None = None, namespace: str | None = None, data_dir: Path | None = None,
                  node: str | None = None) -> Settings:
    return load_settings(redis_url=redis, namespace=namespace, data_dir=data_dir, node=node)


def require_redis_url(settings: Settings, command: str) -> str:
    """The configured Redis URL, else the running embedded Redis's of this data folder; a command
    that has neither ends with one line saying what to do."""
    if settings.redis_url:
        return settings.redis_url
    url = running_url(settings.data_dir)
    if url is None:
        fail(f"{command} needs a Redis: pass --redis URL, set REDIS_URL, or start 'rollstream up' "
             f"(no embedded Redis answers in {embedded_dir(settings.data_dir)})")
    return url


def require_redis(settings: Settings, command: str) -> Settings:
    """Settings whose ``redis_url`` is set (see ``require_redis_url``)."""
    url = require_redis_url(settings, command)
    return settings if url == settings.redis_url else settings.model_copy(update={"redis_url": url})


@contextlib.contextmanager
def redis_for(settings: Settings, *, embedded_ok: bool = True) -> Iterator[str]:
    """Yield a Redis URL: the configured one (checked), or a private embedded server
    that is stopped on exit (an embedded one already running in the data folder is shared)."""
    if settings.redis_url:
        check_sync(sync_redis(settings.redis_url), settings.redis_url)
        yield settings.redis_url
        return
    if not embedded_ok:
        raise SystemExit("set REDIS_URL or pass --redis (this command does not start its own Redis)")
    server = EmbeddedRedis(embedded_dir(settings.data_dir))
    with server:
        console.print(f"[dim]embedded redis-server at {redacted(server.url)} (AOF in {server.data_dir})[/dim]")
        yield server.url
