"""Redis behind Sentinel: the ``redis+sentinel://`` URL that names the Sentinels and the
primary's service name, and clients that ask the Sentinels where the primary is on every
new connection, so a failover is followed without anyone changing REDIS_URL.

    redis+sentinel://[[user]:password@]host1[:port1][,host2[:port2],...]/SERVICE[/DB][?options]

The same grammar as redisvl, prefect and Redis-Sentinel-Url: Sentinels default to port 26379;
the credentials in the URL are the data nodes' (primary and replicas); ``sentinel_username``
and ``sentinel_password`` options authenticate to the Sentinel daemons themselves."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SCHEME = "redis+sentinel"
DEFAULT_PORT = 26379
# A Sentinel that does not answer is skipped for the next one after this long: the address
# of the primary must come quickly during a failover, when one Sentinel may be down.
SENTINEL_TIMEOUT_S = 2.0
_OPTIONS = {"sentinel_username", "sentinel_password"}


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() == SCHEME


def _host_port(member: str, url: str) -> tuple[str, int]:
    if member.startswith("["):  # [::1]:26379
        host, _, rest = member[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = member.partition(":")
    if not host:
        raise ValueError(f"{_redacted(url)}: an empty Sentinel address; list them as host1:26379,host2:26379")
    try:
        return host, int(port) if port else DEFAULT_PORT
    except ValueError:
        raise ValueError(f"{_redacted(url)}: Sentinel port {port!r} is not a number") from None


def parse(url: str) -> SentinelURL:
    """The parts of a ``redis+sentinel://`` URL; ``ValueError`` saying what is wrong."""
    if not is_sentinel_url(url):
        raise ValueError(f"not a Sentinel URL (it starts with {SCHEME}://): {_redacted(url)}")
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        creds, netloc = netloc.rsplit("@", 1)
        user, sep, pw = creds.partition(":")
        username, password = (unquote(user) or None, unquote(pw) or None) if sep else (None, unquote(user) or None)
    sentinels = tuple(_host_port(m.strip(), url) for m in netloc.split(",") if m.strip())
    if not sentinels:
        raise ValueError(f"{_redacted(url)} names no Sentinel; e.g. {SCHEME}://host1:26379,host2:26379/mymaster/0")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"{_redacted(url)}: the path must be /SERVICE or /SERVICE/DB (SERVICE: the name the "
                         "Sentinels monitor the primary under, as in 'sentinel monitor SERVICE host port quorum')")
    try:
        db = int(parts[1]) if len(parts) == 2 else 0
    except ValueError:
        raise ValueError(f"{_redacted(url)}: database {parts[1]!r} is not a number") from None
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"{_redacted(url)}: unknown option(s) {', '.join(sorted(unknown))}; "
                         f"a Sentinel URL takes {', '.join(sorted(_OPTIONS))}")
    return SentinelURL(sentinels, unquote(parts[0]), db, username, password,
                       options.get("sentinel_username") or None, options.get("sentinel_password") or None)


def _redacted(url: str) -> str:
    """The URL without its options or password (connection.redacted: that module imports this one)."""
    url = url.split("?", 1)[0]
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, hosts = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0] if ':' in creds else ''}:***@{hosts}"


def _sentinel_kwargs(parts: SentinelURL) -> dict:
    kwargs: dict = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if parts.sentinel_password:
        kwargs.update(username=parts.sentinel_username, password=parts.sentinel_password)
    return kwargs


class _AsyncPrimary(aioredis.Redis):
    """The primary's client; closing it closes its connections to the Sentinels too."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        await super().aclose(close_connection_pool)
        if manager is not None:
            await manager.aclose()


class _SyncPrimary(redis.Redis):
    def close(self) -> None:
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        super().close()
        for sentinel in getattr(manager, "sentinels", []):
            sentinel.close()


def async_primary(url: str, **connection_kwargs) -> aioredis.Redis:
    """An asyncio client of the primary the Sentinels name now; each new connection asks them
    again (and one to a primary that became a replica is dropped on its first READONLY)."""
    parts = parse(url)
    sentinels = AsyncSentinel(parts.sentinels, sentinel_kwargs=_sentinel_kwargs(parts))
    return sentinels.master_for(parts.service, redis_class=_AsyncPrimary, db=parts.db, username=parts.username,
                                password=parts.password, **connection_kwargs)


def sync_primary(url: str, **connection_kwargs) -> redis.Redis:
    parts = parse(url)
    sentinels = Sentinel(parts.sentinels, sentinel_kwargs=_sentinel_kwargs(parts))
    return sentinels.master_for(parts.service, redis_class=_SyncPrimary, db=parts.db, username=parts.username,
                                password=parts.password, **connection_kwargs)
