"""The OpenCode preset (1.18.33, OpenAI Chat Completions), unmodified, on its own Node.js 22 from the npm registry,
through the whole pipeline: the cases every Node.js CLI preset passes (tests/harness/node_cli_cases.py)."""

import pytest

from .node_cli_cases import *  # noqa: F403  (the shared cases, collected here for this CLI)
from .node_cli_cases import cli_fixtures, the_cli_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored
from .node_clis import OPENCODE

pytestmark = pytest.mark.timeout(1800)  # a first run may install the CLI (npm) and build its image, once
cli, cli_model_dir, opencode_model_dir, cli_swe_model_dir, opencode_swe_model_dir = cli_fixtures(
    OPENCODE, "opencode_model_dir", "opencode_swe_model_dir")
test_the_cli_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored = \
    the_cli_fixes_a_shipped_swe_instance_in_bwrap_and_its_diff_is_scored
