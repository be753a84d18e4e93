"""`rollstream images ...` and `rollstream sandboxes ...`: typer apps the main CLI mounts.

Images are prepared by rq jobs (queue `rollstream-images`) unless --now runs them here;
the sandboxes commands list this node's sandboxes and reap the ones nobody wants.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from rollstream.cli.common import namespace_option, redis_option, redis_url_alias, require_redis, settings_from

from . import images, supervisor_spawn
from .reaper import Reaper

app = typer.Typer(help="Prepare sandbox images (SIF files, unpacked rootfs folders) as background jobs.",
                  no_args_is_help=True)
sandboxes_app = typer.Typer(help="Inspect and clean up this node's sandboxes.", no_args_is_help=True)
console = Console()

REDIS_HELP = ("Redis URL of the rq queue; default $REDIS_URL, else the embedded Redis that 'rollstream up' "
              "runs in the data folder.")
ROOT_HELP = ("Sandbox folder; default $ROLLSTREAM_SANDBOX_ROOT, else /tmp/rollstream-sb-$UID/NAMESPACE "
             "(where the workers of that namespace put theirs).")


def _redis_url(redis: str | None, redis_url: str | None) -> str:
    return require_redis(settings_from(redis or redis_url), "queueing an image job (or pass --now)").redis_url


def _root(root_dir: str | None, namespace: str | None) -> str:
    """The folder the workers of this namespace use, unless one is named."""
    from rollstream.sandboxes.spec import namespace_root_dir

    settings = settings_from(namespace=namespace)
    return root_dir or namespace_root_dir(settings.namespace, settings.sandbox_root)


@app.command()
def pull(
    source: str = typer.Argument(..., help="docker://IMAGE, a .sif file or a rootfs tarball"),
    backend: str = typer.Option("singularity", help="singularity (makes a SIF) or bwrap (unpacks a rootfs folder)"),
    images_dir: str = typer.Option(None, help="where images go; default $ROLLSTREAM_IMAGES_DIR, else ~/.cache/rollstream/images (as root /var/cache/rollstream/images)"),
    now: bool = typer.Option(False, "--now", help="run here and wait instead of queueing an rq job"),
    redis: Optional[str] = redis_option(REDIS_HELP),
    redis_url: Optional[str] = redis_url_alias(),
) -> None:
    """Fetch an image for a backend."""
    if backend not in ("singularity", "bwrap"):
        raise typer.BadParameter("backend must be singularity or bwrap")
    if now:
        with console.status(f"pulling {source} ..."):
            console.print(images.pull_image(source, backend, images_dir))  # type: ignore[arg-type]
        return
    job = images.enqueue_pull(_redis_url(redis, redis_url), source, backend, images_dir)  # type: ignore[arg-type]
    console.print(f"queued rq job {job.id} on {images.IMAGES_QUEUE}; run 'rq worker {images.IMAGES_QUEUE}' on the node")


@app.command()
def build(
    source: str = typer.Argument(..., help="SWE instances (.jsonl/.json: each distinct environment recipe is built "
                                 "once) or an Apptainer/Singularity definition file"),
    name: Optional[str] = typer.Argument(None, help="with a definition file: the image name (NAME.sif)"),
    backend: list[str] = typer.Option(["docker", "bwrap"], "--backend", help="environment images: which artifacts to "
                                      "make: docker (the engine's image), bwrap (an unpacked rootfs), singularity (a SIF)"),
    mirror: Optional[str] = typer.Option(None, help="repository mirror; default $ROLLSTREAM_SWE_MIRROR"),
    force: bool = typer.Option(False, "--force", help="rebuild even when cached"),
    images_dir: str = typer.Option(None, help="where images go; default $ROLLSTREAM_IMAGES_DIR, else ~/.cache/rollstream/images (as root /var/cache/rollstream/images)"),
    now: bool = typer.Option(False, "--now", help="run here and wait instead of queueing an rq job"),
    as_json: bool = typer.Option(False, "--json", help="with --now: print what was built as JSON"),
    redis: Optional[str] = redis_option(REDIS_HELP),
    redis_url: Optional[str] = redis_url_alias(),
) -> None:
    """Build environment images for SWE instances (once per recipe, cached by content), or a SIF from a definition file."""
    if source.endswith((".jsonl", ".json")):
        _build_environments(source, tuple(backend), mirror, images_dir, force, now, as_json, redis, redis_url)
        return
    if name is None:
        raise typer.BadParameter("a definition file needs NAME (the SIF is NAME.sif)")
    if now:
        with console.status(f"building {name} ..."):
            console.print(images.build_image(definition=source, name=name, images_dir=images_dir))
        return
    job = images.enqueue_build(_redis_url(redis, redis_url), source, name, images_dir)
    console.print(f"queued rq job {job.id} on {images.IMAGES_QUEUE}")


def _build_environments(source: str, backends: tuple[str, ...], mirror: str | None, images_dir: str | None,
                        force: bool, now: bool, as_json: bool, redis: str | None, redis_url: str | None) -> None:
    from pathlib import Path

    from rollstream.tasks import swe_env, swe_repos
    from rollstream.tasks.swe import load_instances

    unknown = set(backends) - {"docker", "bwrap", "singularity"}
    if unknown:
        raise typer.BadParameter(f"--backend takes docker, bwrap or singularity, not {sorted(unknown)}")
    instances = load_instances(Path(source))
    mirror_path = Path(mirror) if mirror else swe_repos.default_mirror()
    if now:
        with console.status(f"building the environments of {len(instances)} instance(s) ..."):
            built = swe_env.build_for_instances(instances, mirror_path, backends, images_dir, force)
        if as_json:
            print(json.dumps(built))
            return
        table = Table("image", "built now", "seconds", "rootfs", "instances")
        for entry in built:
            table.add_row(entry["tag"], str(entry["built"]), f"{entry['build_s']:.1f}", entry["rootfs"] or "-",
                          ", ".join(entry["instances"]))
        console.print(table)
        return
    queue = images.images_queue(_redis_url(redis, redis_url))
    for instance in instances:
        job = queue.enqueue(swe_env.build_for_instances, [instance], mirror_path, backends, images_dir, force,
                            job_timeout=3600, description=f"environment of {instance.get('instance_id')}")
        console.print(f"queued rq job {job.id} for {instance.get('instance_id')} on {images.IMAGES_QUEUE}")


@app.command("list")
def list_(
    images_dir: str = typer.Option(None, help="where images are; default $ROLLSTREAM_IMAGES_DIR, else ~/.cache/rollstream/images (as root /var/cache/rollstream/images)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON for scripts"),
) -> None:
    """List prepared images."""
    found = images.list_images(images_dir)
    if as_json:
        print(json.dumps([vars(image) for image in found]))
        return
    table = Table("name", "kind", "size MB", "path")
    for image in found:
        table.add_row(image.name, image.kind, f"{image.size_mb:.1f}", image.path)
    console.print(table)


@sandboxes_app.command("list")
def list_sandboxes(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: Optional[str] = namespace_option(),
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


@sandboxes_app.command()
def reap(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: Optional[str] = namespace_option(),
    all_: bool = typer.Option(False, "--all", help="also destroy running sandboxes (default: only dead leftovers)"),
) -> None:
    """Clean up crashed sandboxes' leftovers (and with --all, every sandbox)."""
    reaped = Reaper(_root(root_dir, namespace)).reap(lambda sandbox_id, owner: not all_)
    console.print(f"reaped {len(reaped)} sandbox(es): {', '.join(reaped) or '-'}")


@sandboxes_app.command("forkserver")
def forkserver_command(
    root_dir: str = typer.Option(None, help=ROOT_HELP),
    namespace: Optional[str] = namespace_option(),
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
    console.print(f"fork server pid {pid} at {supervisor_spawn.socket_path(root)}" if pid else f"no fork server in {root}")
