"""The OpenCode preset (1.18.33, on its own Node.js 22 from the npm registry), unmodified, through
the whole pipeline: the cases every Node.js CLI preset passes (tests/harness/node_cli_cases.py)."""

from __future__ import annotations

import model_cache
import pytest

from .node_cli_cases import *
from .node_clis import OPENCODE

# A first run may install the CLI (npm) and build its image, once: generous.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cli():
    return OPENCODE


@pytest.fixture(scope="module")
def cli_model_dir(opencode_model_dir):
    return opencode_model_dir


@pytest.fixture(scope="module")
def opencode_model_dir():
    return model_cache.load("opencode_model_dir")
