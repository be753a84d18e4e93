"""Self-registration of a built-in server with the Redis balancer (the `rs:backends` ZSET):
added once it serves, removed on a clean shutdown; a crash is left to the health checker."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from rollstream.llm.balancer import add_backend, remove_backend
from rollstream.pipeline.connection import async_redis, check_async

logger = logging.getLogger(__name__)


@dataclass
class Registration:
    redis_url: str
    advertise_url: str
    namespace: str = "rs"
    info: dict = field(default_factory=dict)

    async def register(self) -> None:
        redis = async_redis(self.redis_url)
        try:
            await check_async(redis, self.redis_url)
            await add_backend(
                redis, self.advertise_url, namespace=self.namespace, info={"kind": "builtin", **self.info}
            )
        finally:
            await redis.aclose()
        logger.info("registered %s with the balancer (namespace %s)", self.advertise_url, self.namespace)

    async def deregister(self) -> None:
        redis = async_redis(self.redis_url)
        try:
            await remove_backend(redis, self.advertise_url, namespace=self.namespace)
        except Exception as exc:  # shutting down: the health checker ejects it anyway
            logger.warning("could not deregister %s: %s", self.advertise_url, exc)
        finally:
            await redis.aclose()


def advertise_url_for(host: str, port: int) -> str:
    """The URL other machines use: a wildcard bind address is replaced by this host's name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"
