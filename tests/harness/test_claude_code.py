"""The Claude Code preset (2.1.332, Anthropic Messages, installed with its own Node.js 22), unmodified, through
the whole pipeline: the cases every Node.js CLI preset passes (tests/harness/node_cli_cases.py)."""

from __future__ import annotations

import model_cache
import pytest

from .node_cli_cases import *
from .node_clis import CLAUDE_CODE

# A first run may install the CLI (npm) and build its image, once: generous.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cli():
    return CLAUDE_CODE


@pytest.fixture(scope="module")
def cli_model_dir(claude_code_model_dir):
    return claude_code_model_dir


@pytest.fixture(scope="module")
def claude_code_model_dir():
    return model_cache.load("claude_code_model_dir")
