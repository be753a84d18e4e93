"""``rollstream harnesses ...``: the harness presets (agent/presets.py) a job may name in
``agent.harness``, where each is installed (this host's prefix, for bwrap sandboxes on the host's
own root; the engine's images), and installing one (once, never per rollout)."""

from __future__ import annotations

import json
import subprocess

import typer
from rich.console import Console
from rich.table import Table

from rollstream.agent import presets
from rollstream.agent.presets import PresetError
from rollstream.cli.common import fail
from rollstream.config import load_settings
from rollstream.sandboxes.errors import SandboxError

app = typer.Typer(help="Harness presets: coding agents run unmodified inside the job's sandbox.", no_args_is_help=True)
console = Console()


def _presets() -> dict[str, presets.Preset]:
    try:
        return presets.all_presets(list(load_settings().harness_preset_dirs))
    except presets.PresetError as exc:
        fail(str(exc))


@app.command("list")
def list_presets(
    as_json: bool = typer.Option(False, "--json", help="One JSON object per preset, for scripts."),
) -> None:
    """The presets a job may name ("agent": {"harness": NAME}) and where each is installed."""
    found = [presets.describe(p) for p in _presets().values()]
    if as_json:
        for row in found:
            typer.echo(json.dumps(row))
        return
    table = Table("name", "package", "api", "installed on this host", "images", "preset file")
    for row in found:
        host = row["prefix"] if row["host"] else f"no ({row['prefix']}; rollstream harnesses install {row['name']})"
        package = (row["package"] or "") + (f"\n(node {row['node']})" if row.get("node") else "")  # npm: its own node
        table.add_row(row["name"], package, row["api"], host, "\n".join(row["images"]) or "none", row["file"])
    console.print(table)


@app.command()
def install(
    name: str = typer.Argument(..., help="The preset's name (rollstream harnesses list)."),
    image: str | None = typer.Option(
        None,
        "--image",
        help="Build an environment image: this base image "
        "with the preset installed (its tag is printed). Without it, the "
        "preset is installed on this host, where bwrap sandboxes on the "
        "host's own root find it.",
    ),
) -> None:
    """Install a preset once: into an image built from --image, or into its prefix on this host."""
    preset = _presets().get(name)
    if preset is None:
        fail(f"no preset {name!r}; rollstream harnesses list shows them")
    try:
        where = presets.build_image(preset, image) if image else presets.install_on_host(preset)
    except (RuntimeError, OSError, subprocess.SubprocessError, SandboxError, PresetError) as exc:
        fail(f"installing {name} failed: {exc}")  # a failed build or pip install, in its own words
    typer.echo(where)
