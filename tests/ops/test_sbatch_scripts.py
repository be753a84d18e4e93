"""The slurm/*.sbatch scripts without a cluster: valid bash, every ``rollstream`` command
line they run is one the CLI accepts, and the settings operators rely on are there."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from .cli_check import resolve, unknown_flags

SLURM = Path(__file__).resolve().parents[2] / "slurm"
SCRIPTS = sorted(SLURM.glob("*.sbatch"))


def cli_lines(script: Path) -> list[list[str]]:
    """Each ``$ROLLSTREAM_CMD ...`` command in the script as words after 'rollstream', with
    shell expansions replaced by a placeholder."""
    text = script.read_text().replace("\\\n", " ")
    lines = []
    for match in re.finditer(r"\$ROLLSTREAM_CMD\s+([^\n&|;]*)", text):
        words = []
        for word in shlex.split(match.group(1), comments=True):
            if word.startswith("${") and word.endswith("}") and "[@]" in word:
                continue  # an optional argument list, e.g. ${model_args[@]+...}
            words.append("X" if "$" in word else word)
        lines.append(words)
    return lines


def test_there_are_head_workers_vllm_and_trainer_scripts():
    assert {s.name for s in SCRIPTS} >= {"head.sbatch", "workers.sbatch", "vllm.sbatch", "trainer.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_valid_bash_with_sbatch_directives(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert text.startswith("#!/bin/bash") and "#SBATCH --job-name=" in text
    assert "--signal=B:TERM@" in text, "the batch shell gets SIGTERM before the time limit to stop cleanly"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_commands_exist_in_the_cli(script):
    lines = cli_lines(script)
    assert lines, f"{script.name} runs no rollstream command"
    for words in lines:
        command, args, path = resolve(words)
        assert path, words
        assert not unknown_flags(command, args), f"{script.name}: rollstream {' '.join(words)}"


def test_worker_array_tasks_have_their_own_node_names_and_singularity_sandboxes():
    text = (SLURM / "workers.sbatch").read_text()
    assert "SLURM_ARRAY_TASK_ID" in text and 'ROLLSTREAM_NODE:=' in text
    assert "ROLLSTREAM_SANDBOX_BACKEND:=singularity" in text
    for stage in ("init", "run", "eval"):
        assert f"start {stage} " in text


def test_no_password_on_a_command_line():
    for script in SCRIPTS:
        for words in cli_lines(script):
            assert "--redis" not in words, f"{script.name}: REDIS_URL holds the password; pass it by environment"
    head = (SLURM / "head.sbatch").read_text()
    assert "requirepass" in head and "--requirepass" not in head, "the password reaches redis-server on stdin"
    assert "umask 077" in head
