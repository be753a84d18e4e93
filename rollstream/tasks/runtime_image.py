"""Runtime images: the environment image an ecosystem's server runs in, a base image plus a venv
holding one package at a pinned release (openenv-core for OpenEnv environments, nemo-gym for NeMo
Gym resources servers), built once per node with the container engine; the Docker backend runs
the image, bubblewrap a rootfs exported from it (images.py). The environment's own code is not
baked in where it is a folder of the user's: the task writes it into each sandbox's workdir, so
one image serves every environment of its kind."""

from __future__ import annotations

import asyncio
import hashlib
import shlex
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rollstream.config import load_settings
from rollstream.errors import JobFailed
from rollstream.sandboxes.backends.bwrap import BwrapBackend
from rollstream.sandboxes.env_images import (
    EnvBuildFailed,
    _build,
    build_network,
    image_exists,
)
from rollstream.sandboxes.errors import BackendUnavailable
from rollstream.sandboxes.images import export_rootfs

if TYPE_CHECKING:
    from rollstream.messages import Envelope
    from rollstream.tasks.base import TaskContext

LABEL = "rollstream.runtime"


def python_base_image() -> str:
    """What the operator maps ``python`` images to (as for Harbor's FROM lines)."""
    mapped = load_settings().harbor_base_images
    return mapped.get("python:*") or mapped.get("python") or "localhost/rollstream/python:bookworm"


@dataclass(frozen=True)
class RuntimeImage:
    name: str  # what it is for, in its tag: localhost/rollstream/NAME:VERSION-KEY
    package: str  # "name==version" from PyPI
    base_image_setting: str = ""  # the Settings field naming its base image; "" for python_base_image()
    _building: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def version(self) -> str:
        return self.package.split("==", 1)[1]

    @property
    def prefix(self) -> str:
        """The venv inside the image (and its rootfs)."""
        return f"/opt/rollstream/{self.name}-{self.version}"

    @property
    def python(self) -> str:
        return f"{self.prefix}/bin/python"

    def base_image(self) -> str:
        if self.base_image_setting:
            return str(getattr(load_settings(), self.base_image_setting))
        return python_base_image()

    def tag(self) -> str:
        base = self.base_image()
        digest = hashlib.sha256(f"{base}\n{self.package}\n{self.prefix}".encode()).hexdigest()[:12]
        return f"localhost/rollstream/{self.name}:{self.version}-{digest}"

    def containerfile(self) -> str:
        q = shlex.quote
        return (f"FROM {self.base_image()}\n"
                f"LABEL {LABEL}.{self.name}={self.version}\n"
                f"RUN python3 -m venv {q(self.prefix)} && {q(self.prefix)}/bin/pip install --no-cache-dir "
                f"--disable-pip-version-check -q {q(self.package)}\n")

    def ensure(self, rootfs: bool) -> str:
        """The image's tag, built first if this node lacks it (and its rootfs unpacked for
        bubblewrap when ``rootfs``). Blocking: call it from a thread. EnvBuildFailed names the
        step. One build per process: concurrent init jobs wait for the first."""
        tag = self.tag()
        with self._building:
            if not image_exists(tag):
                with tempfile.TemporaryDirectory(prefix=f"rs-{self.name}-") as context:
                    Path(context, "Containerfile").write_text(self.containerfile())
                    _build(context, tag, build_network())
            if rootfs:
                export_rootfs(tag)
        return tag


    async def prepare(self, env: Envelope, ctx: TaskContext) -> None:
        """A task's ``prepare_environment``: the image on this node (its rootfs too where bwrap
        runs the job's sandbox); a build that fails is the service's to mend (retried)."""
        backend = (env.job.sandbox or {}).get("backend") or (ctx.sandboxes.backend if ctx.sandboxes else "auto")
        rootfs = backend == "bwrap" or (backend == "auto" and BwrapBackend().available())
        try:
            await asyncio.to_thread(self.ensure, rootfs)
        except (EnvBuildFailed, BackendUnavailable, RuntimeError, OSError) as error:
            raise JobFailed(f"{env.job.task}: the runtime image ({self.package} on {self.base_image()}) could not be "
                            f"built ({error}); check DOCKER_HOST and the engine (scripts/install-podman)") from error


# The release each adapter speaks to: OpenEnv's /ws session protocol; NeMo Gym's resources
# server classes (0.4.0 is its last release for Python 3.12; later ones need 3.13.14+).
OPENENV = RuntimeImage("openenv", "openenv-core==0.3.0")
NEMO_GYM = RuntimeImage("nemo-gym", "nemo-gym==0.4.0", base_image_setting="nemo_gym_base_image")
RUNTIMES = {image.name: image for image in (OPENENV, NEMO_GYM)}


if __name__ == "__main__":  # scripts/test builds them before the suite: python -m rollstream.tasks.runtime_image
    import sys

    for name in sys.argv[1:] or list(RUNTIMES):
        print(RUNTIMES[name].ensure(rootfs=True))
