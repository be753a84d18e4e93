"""Checking a deployment file's ``rollstream ...`` command lines against the real CLI: the
sub-command exists, every flag is one it takes, and click accepts the whole line (types,
required options) without running it."""

from __future__ import annotations

from typing import Any

import typer.main

from rollstream.cli.main import app

# typer ships its own copy of click, so commands are matched by shape, not by class.
Command = Any


def cli() -> Command:
    command = typer.main.get_command(app)
    assert hasattr(command, "commands"), "the rollstream CLI is a group of sub-commands"
    return command


def resolve(argv: list[str]) -> tuple[Command, list[str], list[str]]:
    """(command, its arguments, the sub-command path) for ``argv`` without 'rollstream'."""
    command = cli()
    args = list(argv)
    path: list[str] = []
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        if args[0] not in command.commands:
            raise AssertionError(f"'rollstream {' '.join(path + [args[0]])}' is not a command; "
                                 f"known: {sorted(command.commands)}")
        path.append(args[0])
        command = command.commands[args.pop(0)]
    return command, args, path


def unknown_flags(command: Command, args: list[str]) -> list[str]:
    known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and a.split("=", 1)[0] not in known]


def check_command_line(argv: list[str]) -> list[str]:
    """Raise AssertionError if ``rollstream argv...`` would be rejected; returns the
    sub-command path, e.g. ['worker']."""
    command, args, path = resolve(argv)
    bad = unknown_flags(command, args)
    assert not bad, f"'rollstream {' '.join(path)}' has no option(s) {bad}"
    # click parses and type-checks the line exactly as it would at start, without running it.
    command.make_context(" ".join(["rollstream", *path]), list(args))
    return path
