"""``rollstream sandboxes ...``: list this node's sandboxes, reap the ones nobody wants, and
show, start or stop the fork server that spawns their supervisors."""

from __future__ import annotations

import asyncio
import json
import time

import typer
from rich.console import Console
from rich.table import Table

from rollstream.cli.common import namespace_option, settings_from
from rollstream.sandboxes import supervisor_spawn
from rollstream.sandboxes.reaper import Reaper
from rollstream.sandboxes.roots import namespace_root_dir

app = typer.Typer(help="Inspect and clean up this node's sandboxes.", no_args_is_help=True)
console = Console()

ROOT_HELP = ("Sandbox folder; default $ROLLSTREAM_SANDBOX_ROOT, else /tmp/rollstream-sb-$UID/NAMESPACE "
             "(where the workers of that namespace put theirs).")


def _root(root_dir: str | None, namespace: str | None) -> str:
    """The folder the workers of this namespace use, unless one is named."""
    settings = settings_from(namespace=namespace)
    return root_dir or namespace_root_dir(settings.namespace, settings.sandbox_root)


@app.command("list")
def list_sandboxes(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: str | None = namespace_option(),
    as_json: bool = typer.Option(False, "--json", help="print JSON for scripts"),
) -> None:
    """List the sandboxes of this node."""
    records = Reaper(_root(root_dir, namespace)).sandboxes()
    if as_json:
        print(json.dumps([vars(record) for record in records]))
        return
    table = Table("id", "owner", "backend", "running", "age s", "supervisor pid")
    for record in records:
        table.add_row(record.id, record.owner, record.backend, str(record.running),
                      f"{time.time() - record.created_at:.0f}", str(record.supervisor_pid))
    console.print(table)


@app.command()
def reap(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: str | None = namespace_option(),
    all_: bool = typer.Option(False, "--all", help="also destroy running sandboxes (default: only dead leftovers)"),
) -> None:
    """Clean up crashed sandboxes' leftovers (and with --all, every sandbox)."""
    reaped = Reaper(_root(root_dir, namespace)).reap(lambda sandbox_id, owner: not all_)
    console.print(f"reaped {len(reaped)} sandbox(es): {', '.join(reaped) or '-'}")


@app.command("forkserver")
def forkserver_command(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: str | None = namespace_option(),
    start: bool = typer.Option(False, "--start", help="start it now (create_sandbox otherwise does, once)"),
    stop: bool = typer.Option(False, "--stop", help="stop it; its sandboxes live on"),
) -> None:
    """Show, start or stop this node's fork server, which forks sandbox supervisors."""
    root = _root(root_dir, namespace)
    if start and stop:
        raise typer.BadParameter("pass --start or --stop, not both")
    if stop:
        stopped = asyncio.run(supervisor_spawn.stop_fork_server(root))
        console.print("stopped" if stopped else f"no fork server answers in {root}")
        return
    if start and asyncio.run(supervisor_spawn.ping_fork_server(root)) is None:
        asyncio.run(supervisor_spawn.start_fork_server(root))
    pid = asyncio.run(supervisor_spawn.ping_fork_server(root))
    console.print(
        f"fork server pid {pid} at {supervisor_spawn.socket_path(root)}" if pid else f"no fork server in {root}"
    )
