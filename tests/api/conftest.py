from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from rollstream.api.app import asgi

TOKEN = "test-token-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def api_settings(settings):
    return settings


@pytest.fixture
def api_server(api_settings):
    """The real API under uvicorn on a free loopback port; yields its base URL."""
    settings = api_settings
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(asgi(settings, token=TOKEN, max_body_bytes=64 * 1024),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.02)
    yield base
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}
