"""`rollstream --help` teaches: every option of every command says what it is for, flags show
as flags, and the Redis option is spelled `--redis` everywhere (the old `--redis-url` is
still taken, unshown)."""

from __future__ import annotations

import io

import typer.main
from typer.testing import CliRunner

from rollstream.cli.main import app


def _commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    if hasattr(command, "commands"):
        for name, sub in command.commands.items():
            yield from _commands(sub, (*path, name))
    else:
        yield path, command


def test_every_option_of_every_command_has_help():
    missing = [f"rollstream {' '.join(path)} {param.opts[0]}" for path, command in _commands()
               for param in command.params
               if not getattr(param, "hidden", False) and param.name != "help" and not getattr(param, "help", None)]
    assert not missing, f"options without help: {missing}"


def test_help_shows_flags_as_flags_and_one_spelling_of_the_redis_option():
    runner = CliRunner()
    for path, command in _commands():
        text = runner.invoke(app, [*path, "--help"], terminal_width=200).output
        assert "<bool>" not in text, f"rollstream {' '.join(path)} --help shows a flag as taking a value:\n{text}"
        assert "--redis-url" not in text, f"rollstream {' '.join(path)} --help shows --redis-url; say --redis"
        takes_redis = any("--redis" in param.opts for param in command.params)
        if takes_redis:
            assert "--redis " in text


def test_only_commands_that_start_a_redis_say_they_do():
    """'else an embedded redis-server' is said only by commands that start one (up, demo, redis)."""
    runner = CliRunner()
    for path, _command in _commands():
        text = " ".join(runner.invoke(app, [*path, "--help"], terminal_width=400).output.split())
        if path[0] not in ("up", "demo", "redis"):
            assert "else an embedded redis-server" not in text.lower(), f"rollstream {' '.join(path)}"


def test_the_old_redis_url_spelling_still_works_for_images():
    result = CliRunner().invoke(app, ["images", "pull", "docker://x", "--redis-url", "redis://127.0.0.1:1/0"])
    assert "no such option" not in result.output.lower()


def test_sandboxes_commands_look_in_the_folder_of_their_namespace(monkeypatch):
    """Workers of namespace NS put sandboxes (and the fork server) in <root>/NS; the
    operator's commands look there, not in the bare root."""
    monkeypatch.delenv("ROLLSTREAM_SANDBOX_ROOT", raising=False)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", "docsns")
    from rollstream.config import load_settings
    from rollstream.sandboxes.roots import default_root_dir
    from rollstream.workers.node_sandboxes import NodeSandboxes

    expected = f"{default_root_dir()}/docsns"
    assert NodeSandboxes.from_settings(load_settings()).root == expected  # where the workers put them
    text = " ".join(CliRunner().invoke(app, ["sandboxes", "forkserver"], terminal_width=300).output.split())
    assert f"in {expected}" in text


def test_status_view_shows_whole_worker_names_at_80_columns():
    """An operator copies worker names from `status --watch` into redis-cli: never cut."""
    from rich.console import Console

    from rollstream.cli.status_view import render
    from rollstream.pipeline.status import PipelineStatus, StreamStatus, WorkerStatus

    name = "run-gpu-node-0042.cluster.example.org-123456-7f3a9c"
    status = PipelineStatus(
        streams=[StreamStatus(stream="rs:jobs:run:gpu-node-0042", stage="run", node="gpu-node-0042")],
        workers=[WorkerStatus(worker=name, stage="run", node="gpu-node-0042.cluster.example.org")])
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(render(status, 1.0))
    text = console.export_text()
    assert "…" not in text  # rich's mark of a cut cell
    first_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 2)
    assert name in first_column
