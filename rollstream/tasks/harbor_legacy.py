"""Terminal-Bench's original task format as a Harbor task folder, so the ``harbor`` task runs it.

The original format (Terminal-Bench 1 and its dataset adapters: evoeval, aider_polyglot, ...) keeps
``task.yaml`` (instruction, timeouts), a ``Dockerfile`` at the top, ``run-tests.sh`` beside
``tests/`` and ``solution.sh``. Harbor splits them into ``instruction.md``, ``task.toml``,
``environment/``, ``tests/test.sh`` (writing a reward file) and ``solution/solve.sh``. The
conversion keeps every file and runs ``run-tests.sh`` unchanged: reward 1 when it exits 0 (its
pytest ran and every test passed), else 0.

Verification here has no network, while Terminal-Bench's boilerplate run-tests.sh downloads its
test runner (``curl astral.sh/uv/<v>/install.sh | sh``, ``uv add pytest==...``, ``pip install
pytest``). The conversion adds those downloads to the Dockerfile's end instead (package indexes
answer at build time), so the unchanged run-tests.sh finds them installed, uv offline from its
cache. A run-tests.sh that fetches anything else fails offline: a task failure, named.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from rollstream.tasks.harbor_folder import COMPOSE_FILES

# task.yaml is the task's metadata; its docker-compose file only ran the one container (its TEST_DIR
# goes to task.toml), and any compose file Harbor reads in environment/ would make it multi-service.
NOT_CONTEXT = {"task.yaml", *COMPOSE_FILES}
_UV_INSTALLER = re.compile(r"astral\.sh/uv/([0-9][0-9A-Za-z.]*)/install\.sh")
_UV_ADD = re.compile(r"^\s*uv add ([^\n;&|]+)$", re.M)
_PIP_INSTALL = re.compile(r"\bpip3? install ((?:[^\n;&|)]|\\\n)+)")
UV_CACHE = "/opt/rs-uv-cache"
_REWARD_FROM_EXIT = """#!/bin/bash
# Terminal-Bench's run-tests.sh, unchanged; its exit status is the reward (0 -> 1, else 0).
mkdir -p /logs/verifier
{prelude}bash /tests/run-tests.sh
status=$?
if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit "$status"
"""


class LegacyTaskError(ValueError):
    """The folder is not a Terminal-Bench task this conversion can carry over."""


def is_legacy_task(folder: Path) -> bool:
    return (folder / "task.yaml").is_file() and not (folder / "task.toml").exists()


def convert_terminal_bench(source: Path, target: Path) -> Path:
    """Write the Harbor folder of the original-format task ``source`` at ``target`` (new)."""
    meta = _task_yaml(source)
    if not (source / "Dockerfile").is_file():
        raise LegacyTaskError(f"{source}: no Dockerfile (a docker-compose-only task is not supported)")
    if not (source / "run-tests.sh").is_file():
        raise LegacyTaskError(f"{source}: no run-tests.sh")
    instruction = meta.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise LegacyTaskError(f"{source}/task.yaml: no instruction")
    target.mkdir(parents=True)
    (target / "instruction.md").write_text(instruction.rstrip() + "\n")
    environment = target / "environment"
    environment.mkdir()
    for entry in source.iterdir():  # the build context was the whole folder (some Dockerfiles COPY tests/ in)
        if entry.name not in NOT_CONTEXT:
            copy = shutil.copytree if entry.is_dir() and not entry.is_symlink() else shutil.copy2
            copy(entry, environment / entry.name)
    setup, prelude = offline_test_setup((source / "run-tests.sh").read_text())
    (environment / "Dockerfile").write_text((source / "Dockerfile").read_text().rstrip("\n") + "\n" + setup)
    (target / "task.toml").write_text(_task_toml(meta))
    tests = target / "tests"
    if (source / "tests").is_dir():
        shutil.copytree(source / "tests", tests)
    tests.mkdir(exist_ok=True)
    shutil.copy2(source / "run-tests.sh", tests / "run-tests.sh")
    (tests / "test.sh").write_text(_REWARD_FROM_EXIT.replace("{prelude}", prelude))
    if (source / "solution.sh").is_file():
        (target / "solution").mkdir()
        shutil.copy2(source / "solution.sh", target / "solution" / "solve.sh")
    return target


def offline_test_setup(run_tests: str) -> tuple[str, str]:
    """Dockerfile lines that install at build time what ``run_tests`` would download, and the
    shell lines test.sh runs before it (an image's ENV and its /root do not reach a bwrap
    sandbox, so uv's cache lies in /opt and is copied where the tests may write)."""
    prelude = ""
    steps = []
    pip = "(python3 -m pip --version >/dev/null 2>&1 || (apt-get update && apt-get install -y python3-pip)) && " \
          "python3 -m pip install --no-cache-dir --break-system-packages"
    uv = _UV_INSTALLER.search(run_tests)
    if uv:
        # run-tests.sh: apt-get install curl; curl .../install.sh | sh; source $HOME/.local/bin/env
        steps.append("RUN (command -v curl >/dev/null || (apt-get update && apt-get install -y curl)) && "
                     f"{pip} uv=={uv.group(1)} && mkdir -p {UV_CACHE}")
        for packages in _UV_ADD.findall(run_tests):
            # uv's cache then holds what `uv add` resolves; UV_OFFLINE makes the test run use it
            steps.append(f"RUN mkdir /tmp/rs-uv-warm && cd /tmp/rs-uv-warm && export UV_NATIVE_TLS=1 "
                         f"UV_CACHE_DIR={UV_CACHE} && uv init -q && uv add {packages.strip()} && cd / && "
                         "rm -rf /tmp/rs-uv-warm")
        prelude = (f'mkdir -p "$HOME/.local/bin" && touch "$HOME/.local/bin/env"\n'
                   f"cp -a {UV_CACHE} /tmp/rs-uv-cache 2>/dev/null\n"
                   "export UV_CACHE_DIR=/tmp/rs-uv-cache UV_OFFLINE=1\n")
    for match in _PIP_INSTALL.finditer(run_tests):
        words = [w for w in shlex.split(match.group(1).replace("\\\n", " "), comments=True)
                 if not w.startswith("2>") and w not in ("--no-cache-dir", "-q", "--quiet")]
        if words:
            steps.append(f"RUN {pip} {shlex.join(words)}")
    if not steps:
        return "", prelude
    return ("\n# rollstream: what run-tests.sh downloads, installed at build (verification runs offline)\n"
            + "\n".join(steps) + "\n"), prelude


def _task_yaml(source: Path) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - transformers and the dev extra bring it
        raise LegacyTaskError("reading task.yaml needs PyYAML: pip install pyyaml") from exc
    try:
        meta = yaml.safe_load((source / "task.yaml").read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise LegacyTaskError(f"{source}/task.yaml: {exc}") from exc
    if not isinstance(meta, dict):
        raise LegacyTaskError(f"{source}/task.yaml is not a mapping")
    return meta


def _task_toml(meta: dict[str, Any]) -> str:
    agent = float(meta.get("max_agent_timeout_sec") or 360.0)
    verifier = float(meta.get("max_test_timeout_sec") or 60.0)
    return ("# converted from Terminal-Bench's task.yaml by rollstream.tasks.harbor_legacy\n"
            f"[agent]\ntimeout_sec = {agent}\n\n[verifier]\ntimeout_sec = {verifier}\n\n"
            # docker-compose.yaml's TEST_DIR; the slash makes `find $TEST_DIR -maxdepth 1` (as the aider
            # tasks run it) enter the folder, where rollstream's /tests is a link into the sandbox's /tmp
            "[verifier.env]\nTEST_DIR = \"/tests/\"\n")
