"""The Qwen Code preset (0.24.4, on its own Node.js 22 from the npm registry), unmodified, through
the whole pipeline: the cases every Node.js CLI preset passes (tests/harness/node_cli_cases.py)."""

from __future__ import annotations

import model_cache
import pytest

from .node_cli_cases import *
from .node_clis import QWEN_CODE

# A first run may install the CLI (npm) and build its image, once: generous.
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def cli():
    return QWEN_CODE


@pytest.fixture(scope="module")
def cli_model_dir(qwen_code_model_dir):
    return qwen_code_model_dir


@pytest.fixture(scope="module")
def qwen_code_model_dir():
    return model_cache.load("qwen_code_model_dir")
