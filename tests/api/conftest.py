from __future__ import annotations

import pytest

from rollstream.api.app import asgi

TOKEN = "test-token-123"


@pytest.fixture
def api_settings(settings):
    return settings


@pytest.fixture
def api_server(api_settings, asgi_server):
    """The real API under uvicorn on a free loopback port; yields its base URL."""
    with asgi_server(asgi(api_settings, token=TOKEN, max_body_bytes=64 * 1024)) as base:
        yield base


@pytest.fixture
def auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}
