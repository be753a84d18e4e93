"""Redis behind a password, an ACL user confined to one namespace, and TLS: the URLs an
operator puts in REDIS_URL reach every part (client, the three worker processes, the HTTP
API), and wrong credentials fail with an error that says what to do."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import redis as redis_sync

from rollstream.api.app import asgi
from rollstream.client import AsyncClient
from rollstream.errors import RedisUnavailable

PASSWORD = "s3cret-pw"
ACL_USER, ACL_PASSWORD = "trainer", "acl-pw-42"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_certs(folder: Path) -> dict[str, Path]:
    """A private CA and a server certificate for 127.0.0.1, made with openssl."""
    ca_key, ca_crt = folder / "ca.key", folder / "ca.crt"
    key, csr, crt = folder / "server.key", folder / "server.csr", folder / "server.crt"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *args: subprocess.run(args, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=rs-test-ca",
        "-keyout", str(ca_key), "-out", str(ca_crt))
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(key), "-out", str(csr))
    run("openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(crt))
    return {"ca": ca_crt, "cert": crt, "key": key}


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory):
    """A redis-server on loopback only: plain TCP and TLS ports, a default-user password,
    and an ACL user that may touch only keys of the namespace ``acl*``."""
    folder = tmp_path_factory.mktemp("secure-redis")
    certs = _make_certs(folder)
    port, tls_port = _free_port(), _free_port()
    conf = folder / "redis.conf"
    conf.write_text("\n".join([
        "bind 127.0.0.1", f"port {port}", f"tls-port {tls_port}",
        f"tls-cert-file {certs['cert']}", f"tls-key-file {certs['key']}", f"tls-ca-cert-file {certs['ca']}",
        "tls-auth-clients no", f"dir {folder}", "save \"\"", "appendonly no",
        f"requirepass {PASSWORD}",
        # Confined to one namespace's keys and channels; no KEYS/FLUSHALL/CONFIG/DEBUG.
        f"user {ACL_USER} on >{ACL_PASSWORD} ~acl* &acl* +@all -@dangerous",
    ]) + "\n")
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis_sync.Redis(host="127.0.0.1", port=port, password=PASSWORD)
    for _ in range(500):
        try:
            probe.ping()
            break
        except redis_sync.ConnectionError:
            time.sleep(0.01)
    else:
        proc.kill()
        raise RuntimeError("redis-server with TLS did not start: is it built with TLS support?")
    yield {"port": port, "tls_port": tls_port, "ca": certs["ca"]}
    proc.terminate()
    proc.wait(10)


def _echo_jobs(n: int) -> list[dict]:
    return [{"task": "echo", "instance": {"prompt": f"secure-{i}"}} for i in range(n)]


async def _round_trip(settings, worker_pool, url: str, n: int = 20) -> None:
    """Workers and a client, all through ``url``: n echo jobs in, n results out."""
    s = settings.model_copy(update={"redis_url": url})
    pool = worker_pool(redis_url=url, namespace=s.namespace)
    pool.start_all(concurrency=4)
    async with AsyncClient(settings=s) as client:
        await client.submit_many(_echo_jobs(n))
        results = await client.collect(n, timeout_s=60)
    assert sorted(r.trajectory.response_text for r in results) == sorted(f"secure-{i}" for i in range(n))
    assert all(r.ok for r in results)


async def test_password_url_reaches_client_and_worker_processes(settings, worker_pool, secure_redis):
    url = f"redis://:{PASSWORD}@127.0.0.1:{secure_redis['port']}/0"
    await _round_trip(settings, worker_pool, url)


async def test_tls_url_with_acl_user_confined_to_its_namespace(settings, worker_pool, secure_redis):
    settings = settings.model_copy(update={"namespace": "acl" + settings.namespace})
    url = (f"rediss://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{secure_redis['tls_port']}/0"
           f"?ssl_ca_certs={secure_redis['ca']}&ssl_cert_reqs=required")
    await _round_trip(settings, worker_pool, url)
    # The ACL holds: the same user cannot read another namespace's keys.
    confined = redis_sync.Redis.from_url(url)
    with pytest.raises(redis_sync.exceptions.NoPermissionError):
        confined.xlen("rs:jobs:init")


async def test_tls_url_refuses_a_server_it_cannot_verify(settings, secure_redis):
    url = f"rediss://:{PASSWORD}@127.0.0.1:{secure_redis['tls_port']}/0?ssl_cert_reqs=required"
    s = settings.model_copy(update={"redis_url": url})
    with pytest.raises(RedisUnavailable, match="no Redis at rediss://:\\*\\*\\*@"):
        async with AsyncClient(settings=s):
            pass


@pytest.mark.parametrize("credentials", ["", ":wrong", f"{ACL_USER}:wrong"])
async def test_wrong_credentials_say_where_the_password_goes_and_hide_it(settings, secure_redis, credentials):
    at = f"{credentials}@" if credentials else ""
    url = f"redis://{at}127.0.0.1:{secure_redis['port']}/0"
    s = settings.model_copy(update={"redis_url": url})
    with pytest.raises(RedisUnavailable) as err:
        async with AsyncClient(settings=s):
            pass
    message = str(err.value)
    assert "wrong" not in message
    assert "password" in message or "credentials" in message


def test_http_api_serves_through_a_tls_acl_url(settings, secure_redis, asgi_server):
    """The API process talks to Redis with the same URL forms; a submit and a status call
    go through it (the workers are not needed for either)."""
    url = (f"rediss://{ACL_USER}:{ACL_PASSWORD}@127.0.0.1:{secure_redis['tls_port']}/0"
           f"?ssl_ca_certs={secure_redis['ca']}")
    s = settings.model_copy(update={"redis_url": url, "namespace": "acl" + settings.namespace})
    auth = {"Authorization": "Bearer t0k"}
    with asgi_server(asgi(s, token="t0k")) as base:
        submitted = httpx.post(base + "/v1/jobs", json={"task": "echo", "instance": {"prompt": "x"}},
                               headers=auth, timeout=10)
        assert submitted.status_code in (200, 201, 202), submitted.text
        status = httpx.get(base + "/v1/status", headers=auth, timeout=10)
        assert status.status_code == 200, status.text
        assert status.json()["streams"], status.json()
