"""The Codex CLI preset (0.169.0, OpenAI Responses, on its own Node.js 22), unmodified, through
the whole pipeline: the cases every Node.js CLI preset passes (tests/harness/node_cli_cases.py)."""

from __future__ import annotations

import model_cache
import pytest

from .node_cli_cases import *
from .node_clis import CODEX

# A first run may install the CLI (npm) and build its image, once: generous.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cli():
    return CODEX


@pytest.fixture(scope="module")
def cli_model_dir(codex_model_dir):
    return codex_model_dir


@pytest.fixture(scope="module")
def codex_model_dir():
    return model_cache.load("codex_model_dir")
