"""Image preparation for sandboxes, run here (`--now`) or by a node's image worker (workers/image_jobs.py).

`pull_image` makes a SIF (Singularity/Apptainer, through spython) or an unpacked rootfs
folder (bubblewrap's `image`) from a docker:// URI, a SIF or a rootfs tarball (safe_tar.py);
`build_image` builds a SIF from a definition file.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from dataclasses import dataclass
from typing import Literal

from . import safe_tar
from .backends.docker import client_env
from .backends.singularity import singularity_binary
from .errors import BackendUnavailable
from .image_cache import default_images_dir, image_name, rootfs_path, sif_path

ImageBackend = Literal["bwrap", "singularity"]
IMAGES_DIR_MODE = 0o711  # sandboxes under their own uids reach a rootfs they are given, but list nothing


class ImagesDirUnsafe(PermissionError):
    """The images folder is not this user's alone; images are not written into it."""


def images_folder(images_dir: str | None = None) -> str:
    """The images folder, made (mode 0711) when missing; refused when it is a symlink, another user's,
    or writable by others (who could swap a rootfs that every sandbox and the hard-linked cache share)."""
    folder = images_dir or default_images_dir()
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    try:
        os.mkdir(folder, IMAGES_DIR_MODE)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    problem = ("not a folder" if not stat.S_ISDIR(info.st_mode)
               else f"owned by uid {info.st_uid}" if info.st_uid != os.geteuid()
               else "writable by other users" if info.st_mode & 0o022 else None)
    if problem:
        raise ImagesDirUnsafe(f"images folder {folder} is {problem}; images go only into a folder this user "
                              f"(uid {os.geteuid()}) owns: remove it, or pick another with --images-dir / "
                              "ROLLSTREAM_IMAGES_DIR")
    if stat.S_IMODE(info.st_mode) != IMAGES_DIR_MODE:
        os.chmod(folder, IMAGES_DIR_MODE)
    return folder


def _unpack_tarball(tarball: str, destination: str) -> None:
    """Unpack under safe_tar's rules into a private `.partial` folder, renamed only when whole."""
    partial = destination + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.mkdir(partial, 0o700)
    try:
        safe_tar.extract(tarball, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.chmod(partial, 0o755)  # sandboxes under their own uids read the image
    os.replace(partial, destination)


def pull_image(
    source: str, backend: ImageBackend = "singularity", images_dir: str | None = None, force: bool = False
) -> str:
    """Fetch or unpack `source` for `backend`; returns the SIF path or the rootfs folder."""
    images_dir = images_folder(images_dir)
    name = image_name(source)
    if backend == "singularity":
        target = os.path.join(images_dir, f"{name}.sif")
        if os.path.exists(target) and not force:
            return target
        if singularity_binary() is None:
            raise BackendUnavailable("pulling a SIF needs apptainer or singularity on PATH")
        from spython.main import Client

        Client.pull(source, name=f"{name}.sif", pull_folder=images_dir, force=force)
        return target
    target = os.path.join(images_dir, f"{name}.rootfs")
    if os.path.isdir(target) and not force:
        return target
    shutil.rmtree(target, ignore_errors=True)
    if os.path.isfile(source) and tarfile.is_tarfile(source):
        _unpack_tarball(source, target)
    elif (singularity := singularity_binary()) is not None:
        # apptainer unpacks docker:// URIs and SIFs into a plain folder without a daemon.
        subprocess.run([singularity, "build", "--sandbox", target, source], check=True, capture_output=True)
    elif shutil.which("docker") is not None:
        return export_rootfs(source.removeprefix("docker://"), images_dir, force=True)
    else:
        raise BackendUnavailable(
            f"cannot unpack {source!r}: pass a rootfs tarball, or install apptainer or docker to convert images"
        )
    return target


def _docker_env() -> dict[str, str]:
    return {**os.environ, **client_env()}


def export_rootfs(image: str, images_dir: str | None = None, force: bool = False) -> str:
    """Unpack an image the container engine holds into a rootfs folder for bubblewrap."""
    target = rootfs_path(image, images_folder(images_dir))
    if os.path.isdir(target) and not force:
        return target
    env = _docker_env()
    container = (
        subprocess.run(["docker", "create", image, "true"], check=True, capture_output=True, text=True, env=env)
        .stdout.strip()
        .splitlines()[-1]
    )
    tarball = f"{target}.{os.getpid()}.tar"
    try:
        subprocess.run(["docker", "export", "--output", tarball, container], check=True, capture_output=True, env=env)
        staging = f"{target}.{os.getpid()}.new"
        _unpack_tarball(tarball, staging)
        # Replace an older copy whole, so that no sandbox sees half of each.
        old = f"{target}.{os.getpid()}.old"
        if os.path.isdir(target):
            os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        subprocess.run(["docker", "rm", "--force", container], capture_output=True, env=env)
        if os.path.exists(tarball):
            os.remove(tarball)
    return target


def deduplicate(images_dir: str | None = None) -> None:
    """Hard-link identical files across the unpacked rootfs folders (util-linux `hardlink`).

    Environment images share their base: twelve rootfs folders of ~470 MB each take ~0.9 GB
    together once linked. bwrap binds them read-only, so a shared inode is never written."""
    binary = shutil.which("hardlink")
    folder = images_dir or default_images_dir()
    if binary is not None and os.path.isdir(folder):
        subprocess.run([binary, "--quiet", folder], capture_output=True, timeout=3600)


def sif_build_argv(image: str, target: str, archive: str | None = None) -> list[str]:
    """The apptainer/singularity command making a SIF of an engine's image: from a saved OCI
    archive (podman, or Docker without a daemon socket to read) or the Docker daemon."""
    binary = singularity_binary() or "apptainer"
    source = f"oci-archive://{archive}" if archive else f"docker-daemon://{image}"
    return [binary, "build", "--force", target, source]


def sif_from_engine_image(image: str, images_dir: str | None = None, force: bool = False) -> str:
    """A SIF of an image the local engine holds (an environment image), for Singularity."""
    target = sif_path(image, images_dir)
    if os.path.exists(target) and not force:
        return target
    if singularity_binary() is None:
        raise BackendUnavailable("making a SIF needs apptainer or singularity on PATH")
    images_folder(os.path.dirname(target))
    archive = f"{target}.{os.getpid()}.oci.tar"
    try:
        subprocess.run(
            ["docker", "save", "--format", "oci-archive", "--output", archive, image]
            if shutil.which("podman")
            else ["docker", "save", "--output", archive, image],
            check=True,
            capture_output=True,
            env=_docker_env(),
        )
        subprocess.run(sif_build_argv(image, target + ".partial", archive), check=True, capture_output=True)
        os.replace(target + ".partial", target)
    finally:
        if os.path.exists(archive):
            os.remove(archive)
    return target


def build_image(definition: str, name: str, images_dir: str | None = None, force: bool = False) -> str:
    """Build a SIF from a Singularity/Apptainer definition file (spython)."""
    if singularity_binary() is None:
        raise BackendUnavailable("building a SIF needs apptainer or singularity on PATH")
    from spython.main import Client

    images_dir = images_folder(images_dir)
    target = os.path.join(images_dir, f"{image_name(name)}.sif")
    Client.build(recipe=definition, image=target, sudo=False, force=force, options=["--fakeroot"])
    return target


@dataclass
class ImageInfo:
    name: str
    kind: str  # "sif" or "rootfs"
    path: str
    size_mb: float


def list_images(images_dir: str | None = None) -> list[ImageInfo]:
    images_dir = images_dir or default_images_dir()
    found = []
    for entry in sorted(os.listdir(images_dir)) if os.path.isdir(images_dir) else []:
        path = os.path.join(images_dir, entry)
        if entry.endswith(".sif"):
            found.append(ImageInfo(entry[:-4], "sif", path, os.path.getsize(path) / 2**20))
        elif entry.endswith(".rootfs") and os.path.isdir(path):
            size = sum(os.lstat(os.path.join(r, f)).st_size for r, _, fs in os.walk(path) for f in fs)
            found.append(ImageInfo(entry[:-7], "rootfs", path, size / 2**20))
    return found
