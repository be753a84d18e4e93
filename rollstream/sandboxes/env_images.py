"""Environment images: a SWE-bench-harness-style recipe (base image + environment setup +
the repository installed at a commit) built once into an OCI image, cached by content.

The image is built with the container engine (podman or Docker, through the `docker`
CLI); bubblewrap gets an unpacked rootfs exported from it and Singularity a SIF built
from it (images.py). Init never installs: it starts a sandbox from the cached image.
The project is installed editable into a venv at ENV_PREFIX from a checkout at the same
path the task clones it to in the sandbox, so the sandbox's checkout is what imports.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field

from .backends.common import STANDARD_PATH
from .backends.docker import client_env
from .errors import BackendUnavailable
from .image_cache import rootfs_path
from .images import export_rootfs, sif_from_engine_image

log = logging.getLogger(__name__)

DEFAULT_BASE_IMAGE = os.environ.get("ROLLSTREAM_BASE_IMAGE", "localhost/rollstream/python:bookworm")
ENV_PREFIX = "/opt/rs-env"
ENV_REPOSITORY = "localhost/rollstream/env"
RECIPE_FORMAT = 1  # bump when the build steps change, so old images are not reused


class EnvRecipe(BaseModel):
    """How to build one environment; equal recipes share one image."""

    model_config = ConfigDict(extra="forbid")

    base_image: str = Field(DEFAULT_BASE_IMAGE, description="OCI image with python3 (venv) and git")
    python: str | None = Field(None, description="required Python version, e.g. '3.11' (checked at build)")
    pre_install: list[str] = Field(default_factory=list, description="shell commands run as root before install")
    pip_packages: list[str] = Field(default_factory=list, description="pip requirements installed first")
    install: str = Field("python -m pip install -e .", description="run in the checkout with the venv active")
    repo: str = Field(description="owner/name (only for the key and messages)")
    commit: str = Field(description="the commit the environment is installed at (environment_setup_commit)")
    repo_dir: str = Field(description="where the checkout is at build time: the path the sandbox clones it to")

    def key(self) -> str:
        payload = json.dumps({"format": RECIPE_FORMAT, **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    @property
    def tag(self) -> str:
        return f"{ENV_REPOSITORY}:{self.key()}"


def env_variables() -> dict[str, str]:
    """What a sandbox started from an environment image needs in its environment."""
    return {"PATH": f"{ENV_PREFIX}/bin:{STANDARD_PATH}", "VIRTUAL_ENV": ENV_PREFIX}


ENV_PYTHON = f"{ENV_PREFIX}/bin/python"


def docker(*args: str, check: bool = True, timeout: float = 3600,
           extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    binary = shutil.which("docker")
    if binary is None:
        raise BackendUnavailable("building environment images needs the docker CLI and an engine "
                                 "(Docker, or podman's socket: scripts/install-podman)")
    result = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **client_env(), **(extra_env or {})})
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout)[-3000:]}")
    return result


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", "--format", "{{.Id}}", tag, check=False, timeout=60).returncode == 0


def containerfile(recipe: EnvRecipe) -> str:
    """The build steps; the checkout is removed afterwards (sandboxes bring their own)."""
    q = shlex.quote
    steps = ["set -e"]
    if recipe.python:
        want = recipe.python
        steps.append(f'have=$(python3 -c "import sys; print(\'%d.%d\' % sys.version_info[:2])"); '
                     f'case "$have" in {q(want)}*) ;; *) echo "recipe wants Python {want}, the base image has $have; '
                     f'pick a base_image with Python {want}" >&2; exit 3;; esac')
    steps += recipe.pre_install
    steps.append(f"python3 -m venv --system-site-packages {ENV_PREFIX}")  # ipykernel comes from the base
    steps.append(f". {ENV_PREFIX}/bin/activate")
    if recipe.pip_packages:
        steps.append("python -m pip install -q " + " ".join(q(p) for p in recipe.pip_packages))
    steps.append(f"cd {q(recipe.repo_dir)}")
    steps.append(recipe.install)
    steps.append(f"cd / && rm -rf {q(recipe.repo_dir)} /root/.cache")
    script = "; \\\n    ".join(steps[1:])
    return (
        f"FROM {recipe.base_image}\n"
        f"LABEL rollstream.env.key={recipe.key()} rollstream.env.repo={recipe.repo}@{recipe.commit}\n"
        f"COPY repo {recipe.repo_dir}\n"
        f"RUN set -e; {script}\n"
        f"ENV PATH={ENV_PREFIX}/bin:{STANDARD_PATH} VIRTUAL_ENV={ENV_PREFIX}\n"
    )


def _checkout(mirror_entry: str, commit: str, destination: str) -> None:
    """A clone of `mirror_entry` at `commit` (with .git: setuptools_scm and friends need it)."""
    git_env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}
    for argv in (["git", "clone", "-q", "--no-checkout", mirror_entry, destination],
                 ["git", "-C", destination, "-c", "advice.detachedHead=false", "checkout", "-q", "--detach", commit]):
        result = subprocess.run(argv, capture_output=True, text=True, env=git_env, timeout=600)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed: {result.stderr.strip()[-1000:]}")


@dataclass
class BuiltEnv:
    """What `build_env_image` made: the image tag, and per backend its artifact."""

    key: str
    tag: str
    built: bool  # False when the image was already in the cache
    build_s: float
    rootfs: str | None = None
    sif: str | None = None
    rootfs_made: bool = False  # the rootfs was (re)exported by this call

    def to_dict(self) -> dict:
        return asdict(self)


def build_env_image(recipe: EnvRecipe, mirror_entry: str, backends: tuple[str, ...] = ("docker",),
                    images_dir: str | None = None, network: str = "host", force: bool = False) -> BuiltEnv:
    """Build the recipe's image unless cached, then the rootfs/SIF `backends` ask for."""
    started = time.monotonic()
    tag = recipe.tag
    built = False
    if force or not image_exists(tag):
        with tempfile.TemporaryDirectory(prefix="rs-envbuild-", dir=os.environ.get("TMPDIR", "/var/tmp")) as context:
            _checkout(mirror_entry, recipe.commit, os.path.join(context, "repo"))
            with open(os.path.join(context, "Containerfile"), "w") as handle:
                handle.write(containerfile(recipe))
            log.info("building %s for %s@%s", tag, recipe.repo, recipe.commit[:12])
            # The legacy builder: podman's Docker API serves it, and it needs no buildx plugin.
            docker("build", "--network", network, "--file", os.path.join(context, "Containerfile"),
                   "--tag", tag, context, extra_env={"DOCKER_BUILDKIT": "0"})
        built = True
    result = BuiltEnv(recipe.key(), tag, built, 0.0)
    if "bwrap" in backends:
        result.rootfs_made = built or force or not os.path.isdir(rootfs_path(tag, images_dir))
        result.rootfs = export_rootfs(tag, images_dir, force=built or force)
    if "singularity" in backends:
        result.sif = sif_from_engine_image(tag, images_dir, force=built or force)
    result.build_s = time.monotonic() - started
    return result
