"""Every code block of the README and of examples/ runs against a live deployment, as a user
copies it: shell blocks in bash (line by line, stopping at the first failure), Python blocks
in the project's interpreter, the training TOML through the trainer's own loader. Commands
that start a service ran once when the deployment started (tests/docs/conftest.py); the
commands this machine cannot run are listed, with their reason, in blocks.NOT_RUN."""

from __future__ import annotations

import re
import shlex

import pytest
from ops.cli_check import check_command_line

from .blocks import NOT_RUN, SMALLER, Block, all_blocks, commands, not_run_reason, service_kind, strip_comment

BLOCKS = all_blocks()


def _shell_script(block: Block) -> tuple[str, list[str]]:
    """The block as one bash script, and the lines it leaves out (services, NOT_RUN)."""
    lines, left_out = ["set -e", "trap 'echo \"README command failed: $BASH_COMMAND\" >&2' ERR"], []
    for command in commands(block.text):
        if service_kind(command) or not_run_reason(command):
            left_out.append(command)
            continue
        lines.append(command)
    return "\n".join(lines) + "\n", left_out


def _check_rollstream_line(command: str) -> None:
    """A line that is not run is still a valid 'rollstream ...' command line."""
    words = shlex.split(strip_comment(command).rstrip("& "))
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value prefixes
        words.pop(0)
    if words and words[0] == "rollstream":
        check_command_line(words[1:])


def _smaller(text: str) -> str:
    for big, small in SMALLER.items():
        text = text.replace(big, small)
    return text


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs_as_printed(block, deployment):
    if block.lang in ("", "text"):
        # A diagram: make sure no command hides in a block that is not run.
        prompts = ("rollstream ", "$ ", "python ")
        assert not any(line.lstrip().startswith(prompts) for line in block.text.splitlines()), \
            f"{block.id} looks like commands: give it a language (```bash) so it runs"
        return
    if block.lang in ("bash", "sh"):
        script, left_out = _shell_script(block)
        for command in left_out:
            _check_rollstream_line(command)
            kind = service_kind(command)
            if kind:
                assert kind in deployment.services, f"{command!r}: no such service in the deployment"
        result = deployment.run(["bash", "-c", script])
        assert result.returncode == 0, (
            f"{block.id} ({block.heading}) failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        return
    if block.lang == "python":
        env = dict(deployment.env)
        if "REDIS_URL" in block.text:  # the block says the user exported it, as 'up' printed it
            env["REDIS_URL"] = f"unix://{deployment.home}/.local/share/rollstream/redis/redis.sock"
        source = _smaller(block.text)
        result = deployment.run(["python", "-"], env=env, input_text=source, timeout_s=170)
        assert result.returncode == 0, (
            f"{block.id} ({block.heading}) failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        return
    if block.lang == "toml":
        # The training config is read by the trainer's own loader (training itself:
        # tests/trainer, and bench/arith_rl.py for 15 steps).
        (deployment.work / "train.toml").write_text(block.text)
        check = "from rollstream.trainer.config import TrainConfig; print(TrainConfig.from_toml('train.toml'))"
        result = deployment.run(["python", "-c", check])
        assert result.returncode == 0, f"{block.id}: the trainer refuses the README's config:\n{result.stderr[-3000:]}"
        return
    pytest.fail(f"{block.id}: no runner for ```{block.lang} blocks; add one to tests/docs/test_readme.py")


def test_what_the_docs_tests_do_not_run_is_listed_and_still_in_the_docs():
    """Each NOT_RUN entry names a command the docs hold (a stale entry would hide a new
    block), and each SMALLER size is still printed where the docs test turns it down."""
    every_command = [c for b in BLOCKS if b.lang in ("bash", "sh") for c in commands(b.text)]
    for pattern, reason in NOT_RUN.items():
        assert reason
        assert any(re.search(pattern, strip_comment(c)) for c in every_command), \
            f"NOT_RUN entry {pattern!r} matches no command of the docs any more: remove it"
    for big in SMALLER:
        assert any(big in b.text for b in BLOCKS), f"SMALLER entry {big!r} is no longer in the docs"
    for command in every_command:
        if not_run_reason(command) or service_kind(command):
            _check_rollstream_line(command)


def test_every_example_program_is_run_by_a_docs_block():
    """An example program is documented by a block that runs it (so it runs here too)."""
    from .blocks import ROOT

    texts = "\n".join(b.text for b in BLOCKS)
    programs = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "examples").rglob("*.py"))]
    unrun = [p for p in programs if p not in texts]
    assert not unrun, f"example programs no README block runs: {unrun}; show how to run each in a README block"
