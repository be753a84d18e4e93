"""``rollstream images ...``: prepare sandbox images (SIF files, unpacked rootfs folders, SWE
environment images). They are built by image workers on the nodes (``rollstream images worker``
reads typed requests from Redis: workers/image_jobs.py) unless --now builds them here."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from rollstream.agent import harness_images
from rollstream.cli.common import fail, redis_option, redis_url_alias, require_redis_url, settings_from
from rollstream.config import load_settings
from rollstream.errors import InvalidJob
from rollstream.sandboxes import images
from rollstream.sandboxes.env_images import EnvBuildFailed
from rollstream.tasks import swe_env, swe_repos
from rollstream.tasks.swe import load_instances
from rollstream.workers import image_jobs

app = typer.Typer(help="Prepare sandbox images (SIF files, unpacked rootfs folders) as requests to image workers.",
                  no_args_is_help=True)
console = Console()

REDIS_HELP = ("Redis URL of the image requests; default $REDIS_URL, else the embedded Redis that 'rollstream up' "
              "runs in the data folder.")


def _redis_url(redis: str | None, redis_url: str | None) -> str:
    return require_redis_url(settings_from(redis or redis_url), "queueing an image request (or pass --now)")


WORKER_OWNS = ("a queued request runs with the worker's own folders: pass {flag} to 'rollstream images worker', "
               "or build here with --now")


def _queued(request_id: str, what: str) -> None:
    console.print(f"queued image request {request_id} ({what}) on {image_jobs.STREAM}; "
                  "a node's 'rollstream images worker' runs it")


IMAGES_DIR_HELP = (
    "where images go; default $ROLLSTREAM_IMAGES_DIR, else ~/.cache/rollstream/images"
    " (as root /var/cache/rollstream/images)"
)


@app.command()
def pull(
    source: str = typer.Argument(..., help="docker://IMAGE, a .sif file or a rootfs tarball"),
    backend: str = typer.Option("singularity", help="singularity (makes a SIF) or bwrap (unpacks a rootfs folder)"),
    images_dir: str = typer.Option(None, help=IMAGES_DIR_HELP),
    now: bool = typer.Option(False, "--now", help="run here and wait instead of queueing an rq job"),
    redis: str | None = redis_option(REDIS_HELP),
    redis_url: str | None = redis_url_alias(),
) -> None:
    """Fetch an image for a backend."""
    if backend not in ("singularity", "bwrap"):
        raise typer.BadParameter("backend must be singularity or bwrap")
    if now:
        with console.status(f"pulling {source} ..."):
            console.print(images.pull_image(source, backend, images_dir))  # type: ignore[arg-type]
        return
    if images_dir is not None:
        raise typer.BadParameter(WORKER_OWNS.format(flag="--images-dir"))
    request = image_jobs.PullRequest(source=source, backend=backend)
    _queued(image_jobs.enqueue(_redis_url(redis, redis_url), request), f"pull {source} for {backend}")


@app.command()
def build(
    source: str = typer.Argument(
        ...,
        help="SWE instances (.jsonl/.json: each distinct environment recipe is built "
        "once) or an Apptainer/Singularity definition file",
    ),
    name: str | None = typer.Argument(None, help="with a definition file: the image name (NAME.sif)"),
    backend: list[str] = typer.Option(
        ["docker", "bwrap"],
        "--backend",
        help="environment images: which artifacts to "
        "make: docker (the engine's image), bwrap (an unpacked rootfs), singularity (a SIF)",
    ),
    mirror: str | None = typer.Option(None, help="repository mirror; default $ROLLSTREAM_SWE_MIRROR"),
    force: bool = typer.Option(False, "--force", help="rebuild even when cached"),
    images_dir: str = typer.Option(None, help=IMAGES_DIR_HELP),
    now: bool = typer.Option(False, "--now", help="run here and wait instead of queueing an rq job"),
    as_json: bool = typer.Option(False, "--json", help="with --now: print what was built as JSON"),
    harness: list[str] = typer.Option(
        [],
        "--harness",
        help="environment images: install this harness preset onto each environment image too (its "
        "layer, which jobs naming the preset start from: the engine's image, and its rootfs/SIF for "
        "--backend bwrap/singularity); queued, the image worker builds it with its own preset folders; repeatable",
    ),
    redis: str | None = redis_option(REDIS_HELP),
    redis_url: str | None = redis_url_alias(),
) -> None:
    """Build environment images for SWE instances (once per recipe, cached by content),
    or a SIF from a definition file."""
    if source.endswith((".jsonl", ".json")):
        _build_environments(source, tuple(backend), mirror, images_dir, force, now, as_json, redis, redis_url,
                            harness)
        return
    if harness:
        raise typer.BadParameter("--harness goes with SWE instances (.jsonl/.json): it layers onto their environments")
    if name is None:
        raise typer.BadParameter("a definition file needs NAME (the SIF is NAME.sif)")
    if now:
        with console.status(f"building {name} ..."):
            console.print(images.build_image(definition=source, name=name, images_dir=images_dir))
        return
    if images_dir is not None:
        raise typer.BadParameter(WORKER_OWNS.format(flag="--images-dir"))
    request_id = image_jobs.enqueue(
        _redis_url(redis, redis_url), image_jobs.SifBuildRequest(definition=source, name=name)
    )
    _queued(request_id, f"build {name}")


def _build_environments(
    source: str,
    backends: tuple[str, ...],
    mirror: str | None,
    images_dir: str | None,
    force: bool,
    now: bool,
    as_json: bool,
    redis: str | None,
    redis_url: str | None,
    harness: list[str],
) -> None:
    unknown = set(backends) - {"docker", "bwrap", "singularity"}
    if unknown:
        raise typer.BadParameter(f"--backend takes docker, bwrap or singularity, not {sorted(unknown)}")
    try:  # known here too (queued, the worker looks the names up in its own folders)
        layered = harness_images.harness_presets(harness, list(load_settings().harness_preset_dirs))
    except (ValueError, InvalidJob) as error:
        raise typer.BadParameter(str(error)) from None
    instances = load_instances(Path(source))
    if now:
        mirror_path = Path(mirror) if mirror else swe_repos.default_mirror()
        try:
            with console.status(f"building the environments of {len(instances)} instance(s) ..."):
                built = swe_env.build_for_instances(instances, mirror_path, backends, images_dir, force)
            if layered:  # on each environment image, once (cached by tag): what preset jobs on podman start from
                with console.status(f"installing {', '.join(harness)} onto {len(built)} environment(s) ..."):
                    harness_images.add_layers(built, layered, backends, images_dir)
        except (EnvBuildFailed, ValidationError, RuntimeError) as error:
            fail(str(error), code=1)
        if as_json:
            print(json.dumps(built))
            return
        table = Table("image", "built now", "seconds", "rootfs", "harness layers", "instances")
        for entry in built:
            table.add_row(
                entry["tag"],
                str(entry["built"]),
                f"{entry['build_s']:.1f}",
                entry["rootfs"] or "-",
                "\n".join(entry.get("harnesses", {}).values()) or "-",
                ", ".join(entry["instances"]),
            )
        console.print(table)
        return
    for flag, value in (("--mirror", mirror), ("--images-dir", images_dir)):
        if value is not None:
            raise typer.BadParameter(WORKER_OWNS.format(flag=flag))
    url = _redis_url(redis, redis_url)
    for instance in instances:
        request = image_jobs.EnvironmentsRequest.model_validate(
            {"instances": [instance], "backends": list(backends), "force": force, "harnesses": harness}
        )
        _queued(image_jobs.enqueue(url, request), f"environment of {instance.get('instance_id')}")


@app.command()
def worker(
    images_dir: str = typer.Option(None, help=IMAGES_DIR_HELP),
    mirror: str | None = typer.Option(
        None, help="repository mirror of environment builds; default $ROLLSTREAM_SWE_MIRROR"
    ),
    source_dir: list[str] = typer.Option(
        [],
        "--source-dir",
        help="a folder queued pulls may take local tarballs and "
        "SIFs (and SIF builds their definition files) from; repeatable; none by "
        "default: registry URIs only",
    ),
    burst: bool = typer.Option(False, "--burst", help="stop once no request is waiting"),
    redis: str | None = redis_option(REDIS_HELP),
    redis_url: str | None = redis_url_alias(),
) -> None:
    """Run queued image requests on this node: pulls, SIF builds and environment images.

    A request is typed data (JSON of one of three kinds), never a function or a pickle: whoever can
    write to Redis can ask for an image, not run code here. Folders come from these flags only."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = require_redis_url(settings_from(redis or redis_url), "running an image worker")
    preset_dirs = [str(folder) for folder in load_settings().harness_preset_dirs]
    answered = image_jobs.ImageWorker(url, images_dir, mirror, list(source_dir), preset_dirs=preset_dirs).work(
        burst=burst)
    console.print(f"answered {answered} image request(s)")


@app.command()
def result(
    request_id: str = typer.Argument(..., help="the id 'rollstream images pull|build' printed"),
    redis: str | None = redis_option(REDIS_HELP),
    redis_url: str | None = redis_url_alias(),
) -> None:
    """Print a queued request's outcome as JSON (status finished, failed or refused), or say it is waiting."""
    outcome = image_jobs.result(_redis_url(redis, redis_url), request_id)
    if outcome is None:
        console.print(f"request {request_id} is not answered yet (or its result expired)")
        raise typer.Exit(1)
    print(json.dumps(outcome))


@app.command("list")
def list_(
    images_dir: str = typer.Option(
        None,
        help=IMAGES_DIR_HELP.replace("go;", "are;"),
    ),
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
