"""Where prepared images live on a node, and what each backend runs for a sandbox's `image`.

images.py and env_images.py fill the cache (SIF files, unpacked rootfs folders); the
backends only read it, through `resolve_image`.
"""

from __future__ import annotations

import os
import re

from .runtime.env_settings import env_setting


def default_images_dir() -> str:
    """$ROLLSTREAM_IMAGES_DIR, else /var/cache/rollstream/images as root (bwrap runs sandboxes under
    an unprivileged uid, which could not reach a rootfs inside /root), else ~/.cache/rollstream/images."""
    if configured := env_setting("IMAGES_DIR"):
        return configured
    return "/var/cache/rollstream/images" if os.geteuid() == 0 else os.path.expanduser("~/.cache/rollstream/images")


def image_name(source: str) -> str:
    """A file-system-safe name for an image source (docker://python:3.11 -> python_3.11)."""
    base = source.split("://", 1)[-1]
    base = re.sub(r"\.(tar|tar\.gz|tgz|sif)$", "", os.path.basename(base) if os.path.exists(source) else base)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", base).strip("_") or "image"


def rootfs_path(image: str, images_dir: str | None = None) -> str:
    """Where the unpacked rootfs of an OCI image lives in the images folder."""
    return os.path.join(images_dir or default_images_dir(), f"{image_name(image)}.rootfs")


def sif_path(image: str, images_dir: str | None = None) -> str:
    return os.path.join(images_dir or default_images_dir(), f"{image_name(image)}.sif")


def resolve_image(image: str | None, backend: str, images_dir: str | None = None) -> str | None:
    """What `backend` runs for a sandbox's `image`: bwrap a rootfs folder (the image's unpacked
    copy from the cache), Docker the reference, Singularity a SIF (cached, else docker://)."""
    if image is None:
        return None
    # Only an absolute path names a host folder or file: a reference (localhost/x, etc) is never
    # looked up relative to whatever folder the worker runs in.
    if backend == "bwrap":
        if os.path.isabs(image) and os.path.isdir(image):
            return image
        unpacked = rootfs_path(image, images_dir)
        if os.path.isdir(unpacked):
            return unpacked
        raise FileNotFoundError(
            f"bwrap image {image!r} is neither a folder nor unpacked in {os.path.dirname(unpacked)}; "
            f"unpack it first (rollstream images pull --backend bwrap {image}, or for an environment "
            "recipe rollstream images build INSTANCES.jsonl --backend bwrap)"
        )
    if backend == "singularity":
        if image.endswith(".sif") or (os.path.isabs(image) and os.path.isdir(image)) or "://" in image:
            return image
        cached = sif_path(image, images_dir)
        return cached if os.path.exists(cached) else f"docker://{image}"
    if backend == "docker" and (os.path.isdir(image) or image.endswith(".sif")):
        raise ValueError(f"backend='docker' runs an image reference, not a folder or SIF: {image!r}")
    return image
