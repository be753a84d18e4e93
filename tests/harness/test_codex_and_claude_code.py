"""The Codex CLI (0.169.0) and Claude Code (2.1.332) presets, installed from npm with their own
Node.js 22, run unmodified in a bubblewrap sandbox. Their runs through the pipeline wait on the door
(README, "Codex CLI" and "Claude Code"): here, the cases of tests/harness/node_cli_cases.py that
need no model."""

from __future__ import annotations

import pytest

from .node_cli_cases import preset, test_the_cli_runs_on_its_own_node_in_a_bwrap_sandbox  # noqa: F401
from .node_clis import CLAUDE_CODE, CODEX

pytestmark = pytest.mark.timeout(1800)  # a first run may install the CLI (npm), once


@pytest.fixture(scope="module", params=[CODEX, CLAUDE_CODE], ids=lambda cli: cli.preset)
def cli(request):
    return request.param
