"""The environment image an OpenEnv server runs in: the node's base image plus a venv holding
``openenv-core`` at the pinned release (the server framework every OpenEnv environment imports),
built once per node with the container engine; the Docker backend runs the image, bubblewrap a
rootfs exported from it (images.py). The environment's own code is not baked in: it is written
into each sandbox's workdir (openenv_env.py), so one image serves every environment folder."""

from __future__ import annotations

import hashlib
import shlex
import tempfile
import threading
from pathlib import Path

from rollstream.config import load_settings
from rollstream.sandboxes.env_images import _build, build_network, image_exists
from rollstream.sandboxes.images import export_rootfs

PACKAGE = "openenv-core==0.3.0"  # the release the adapter speaks to (its /ws session protocol)
PREFIX = "/opt/rollstream/openenv-0.3.0"
PYTHON = f"{PREFIX}/bin/python"
IMAGE_REPOSITORY = "localhost/rollstream/openenv"
LABEL = "rollstream.openenv"
_building = threading.Lock()  # one build per process: concurrent init jobs wait for the first


def base_image() -> str:
    """The image the runtime is built on: what the operator maps ``python`` images to."""
    mapped = load_settings().harbor_base_images
    return mapped.get("python:*") or mapped.get("python") or "localhost/rollstream/python:bookworm"


def image_tag(base_image: str) -> str:
    digest = hashlib.sha256(f"{base_image}\n{PACKAGE}\n{PREFIX}".encode()).hexdigest()[:12]
    return f"{IMAGE_REPOSITORY}:{PACKAGE.split('==')[1]}-{digest}"


def containerfile(base_image: str) -> str:
    q = shlex.quote
    return (f"FROM {base_image}\n"
            f"LABEL {LABEL}={PACKAGE.split('==')[1]}\n"
            f"RUN python3 -m venv {q(PREFIX)} && {q(PREFIX)}/bin/pip install --no-cache-dir "
            f"--disable-pip-version-check -q {q(PACKAGE)}\n")


def ensure_image(base_image: str, rootfs: bool) -> str:
    """The runtime image's tag, built first if this node lacks it (and its rootfs unpacked for
    bubblewrap when ``rootfs``). Blocking: call it from a thread. EnvBuildFailed names the step."""
    tag = image_tag(base_image)
    with _building:
        if not image_exists(tag):
            with tempfile.TemporaryDirectory(prefix="rs-openenv-") as context:
                Path(context, "Containerfile").write_text(containerfile(base_image))
                _build(context, tag, build_network())
        if rootfs:
            export_rootfs(tag)
    return tag



if __name__ == "__main__":  # scripts/test builds it before the suite: `python -m rollstream.tasks.openenv_runtime`
    print(ensure_image(base_image(), rootfs=True))
