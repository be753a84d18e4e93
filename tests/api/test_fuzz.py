"""Fuzz the OpenAPI spec with schemathesis: no request may produce a 5xx or hang. Driven with
hypothesis directly: schemathesis's pytest plugin (``from_fixture``) reads a pytest attribute
that pytest 9 removed (``_nodeid``)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings


@pytest.fixture
def api_settings(settings):
    # Long-polls end fast: the results page and stream wait up to this per request (their bounds in the
    # spec come from it), and they were two thirds of the fuzz's time at 0.5 s; 0.1 is the stream's floor.
    return settings.model_copy(update={"api_max_wait_s": 0.1})


def test_no_request_makes_the_api_fail(api_server, auth):
    schema = schemathesis.openapi.from_url(api_server + "/openapi.json", headers=auth)  # the spec is behind the token
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 10
    for operation in operations:
        @given(case=operation.as_strategy())
        @hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            response = case.call(headers=auth, timeout=15)
            assert response.status_code < 500, (
                f"{case.method} {case.path}: {response.status_code} {response.text[:500]}")

        no_5xx()
