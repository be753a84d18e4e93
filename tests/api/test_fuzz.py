"""Fuzz the OpenAPI spec with schemathesis: no request may produce a 5xx or hang."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings as hsettings

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture
def api_settings(settings):
    return settings.model_copy(update={"api_max_wait_s": 0.5})  # long-polls end fast


@pytest.fixture
def api_schema(api_server, auth):
    return schemathesis.openapi.from_url(api_server + "/openapi.json", headers=auth)  # the spec is behind the token


@schema.parametrize()
@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_makes_the_api_fail(case, auth):
    response = case.call(headers=auth, timeout=15)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
