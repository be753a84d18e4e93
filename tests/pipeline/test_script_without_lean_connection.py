"""Where no lean connection can be had (TLS, or redis-py without hiredis's packer), a write that
must reach replicas goes through redis-py's pipeline: the script and the WAIT in one round trip."""

from __future__ import annotations

from rollstream.pipeline.connection import async_redis
from rollstream.pipeline.replication import script_then_wait

SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); return 7"


async def test_a_script_and_its_wait_run_on_redis_pys_pipeline(redis_url, namespace):
    r = async_redis(redis_url)
    try:
        reply, confirmed = await script_then_wait(r, None, SCRIPT, [f"{namespace}:k"], ["v"], acks=0, timeout_ms=100)
        assert (int(reply), confirmed) == (7, 0)
        assert await r.get(f"{namespace}:k") == b"v"
    finally:
        await r.aclose()
