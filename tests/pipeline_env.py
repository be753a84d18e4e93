"""Pipeline settings the tests share: short timeouts (FAST) and the same settings as a worker
subprocess's environment. A module of its own, importable by that one name from any test folder:
`from conftest import ...` resolves to whichever folder's conftest.py pytest imported last."""

from __future__ import annotations

from rollstream.config import Settings

FAST = {
    "visibility_timeout_s": 2.0,
    "heartbeat_interval_s": 0.5,
    "worker_ttl_s": 3.0,
    "max_deliveries": 3,
    "shutdown_grace_s": 5.0,
    "read_block_ms": 200,
}


def settings_env(s: Settings) -> dict[str, str]:
    """The same settings as environment variables, for worker subprocesses."""
    env = {"REDIS_URL": s.redis_url or "", "ROLLSTREAM_NAMESPACE": s.namespace, "ROLLSTREAM_NODE": s.node,
           "ROLLSTREAM_DATA_DIR": str(s.data_dir), "ROLLSTREAM_EVENT_LOOP": s.event_loop}
    for k in FAST:
        env[f"ROLLSTREAM_{k.upper()}"] = str(getattr(s, k))
    for k in ("model_dir", "sandbox_root"):  # where run workers find the tokenizer and sandboxes live
        if getattr(s, k):
            env[f"ROLLSTREAM_{k.upper()}"] = str(getattr(s, k))
    return env
