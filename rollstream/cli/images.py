"""``rollstream images ...``: prepare sandbox images (SIF files, unpacked rootfs folders, SWE
environment images). They are built by rq jobs (queue ``rollstream-images``) on the nodes
unless --now builds them here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from rollstream.cli.common import redis_option, redis_url_alias, require_redis, settings_from
from rollstream.sandboxes import images
from rollstream.tasks import swe_env, swe_repos
from rollstream.tasks.swe import load_instances

app = typer.Typer(help="Prepare sandbox images (SIF files, unpacked rootfs folders) as background jobs.",
                  no_args_is_help=True)
console = Console()

REDIS_HELP = ("Redis URL of the rq queue; default $REDIS_URL, else the embedded Redis that 'rollstream up' "
              "runs in the data folder.")


def _redis_url(redis: str | None, redis_url: str | None) -> str:
    return require_redis(settings_from(redis or redis_url), "queueing an image job (or pass --now)").redis_url


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
