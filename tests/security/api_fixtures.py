"""The real API under uvicorn for the API security tests (this folder does not see
tests/api/conftest.py): import ``api`` into a test module; it yields the base URL, the
headers that carry the token, and the API's settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollstream.api.app import asgi

TOKEN = "security-test-token"


@pytest.fixture
def api(settings, asgi_server):
    served = settings.model_copy(update={"api_max_wait_s": 2.0})
    with asgi_server(asgi(served, token=TOKEN, max_body_bytes=64 * 1024)) as base:
        yield SimpleNamespace(url=base, auth={"Authorization": f"Bearer {TOKEN}"}, settings=served)
