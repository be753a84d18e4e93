"""Environment images: a SWE-bench-harness-style recipe (base image + environment setup +
the repository installed at a commit) built once into an OCI image, cached by content.

The image is built with the container engine (podman or Docker, through the `docker`
CLI); bubblewrap gets an unpacked rootfs exported from it and Singularity a SIF built
from it (images.py). Init never installs: it starts a sandbox from the cached image.
The project is installed editable into a venv at ENV_PREFIX from a checkout at the same
path the task clones it to in the sandbox, so the sandbox's checkout is what imports.

A recipe comes from a job, so a build is treated as hostile code: it runs on the engine's own
private network (PyPI yes, the host's loopback services no) or none, never the host's; the
fields that reach the Containerfile outside a quoted shell word are checked against their
grammar, and none may hold a line break (which would add Containerfile instructions).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .backends.common import STANDARD_PATH
from .backends.docker import client_env
from .errors import BackendUnavailable
from .image_cache import rootfs_path
from .images import export_rootfs, sif_from_engine_image
from .runtime.env_settings import env_setting

log = logging.getLogger(__name__)

DEFAULT_BASE_IMAGE = env_setting("BASE_IMAGE", "localhost/rollstream/python:bookworm")
ENV_PREFIX = "/opt/rs-env"
ENV_REPOSITORY = "localhost/rollstream/env"
RECIPE_FORMAT = 1  # bump when the build steps change, so old images are not reused
BUILD_NETWORKS = ("default", "none")
STEP_MARK = "rollstream build step "

# An image reference (distribution/reference's grammar): [domain[:port]/]path[:tag][@digest].
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(rf"(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                             r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
REPO_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}/[A-Za-z0-9_.-]{1,100}")
COMMIT = re.compile(r"[0-9a-fA-F]{7,40}")
PYTHON_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+){0,2}")
REPO_DIR = re.compile(r"(?:/[A-Za-z0-9_.-]+)+")


class EnvBuildFailed(RuntimeError):
    """An environment image did not build; the message names the failing step and its last output."""


def build_network() -> str:
    """$ROLLSTREAM_ENV_BUILD_NETWORK: 'default' (the engine's own private network) or 'none'."""
    network = env_setting("ENV_BUILD_NETWORK", "default")
    if network not in BUILD_NETWORKS:
        raise ValueError(f"ROLLSTREAM_ENV_BUILD_NETWORK={network!r}: environment builds run on 'default' (the "
                         "engine's private network: package indexes yes, the host's loopback no) or 'none'; "
                         "the host's own network is never given to a build")
    return network


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

    @field_validator("base_image")
    @classmethod
    def _image_reference(cls, value: str) -> str:
        if len(value) > 255 or not IMAGE_REFERENCE.fullmatch(value):
            raise ValueError(f"base_image {value[:100]!r} is not an image reference ([registry/]name[:tag][@digest])")
        return value

    @field_validator("repo")
    @classmethod
    def _repo_name(cls, value: str) -> str:
        if not REPO_NAME.fullmatch(value) or value.split("/")[1] in (".", ".."):
            raise ValueError(f"repo {value[:100]!r} is not owner/name (letters, digits, '_', '.', '-')")
        return value

    @field_validator("commit")
    @classmethod
    def _hex_commit(cls, value: str) -> str:
        if not COMMIT.fullmatch(value):
            raise ValueError(f"environment_setup_commit {value[:100]!r} is not a commit id (7 to 40 hex digits)")
        return value

    @field_validator("python")
    @classmethod
    def _python_version(cls, value: str | None) -> str | None:
        if value is not None and not PYTHON_VERSION.fullmatch(value):
            raise ValueError(f"python {value[:100]!r} is not a version such as 3.11 or 3.11.7")
        return value

    @field_validator("repo_dir")
    @classmethod
    def _absolute_plain_path(cls, value: str) -> str:
        if not REPO_DIR.fullmatch(value) or any(part in (".", "..") for part in value.split("/")):
            raise ValueError(f"repo_dir {value[:100]!r} is not an absolute path of plain names")
        return value

    @field_validator("pre_install", "pip_packages")
    @classmethod
    def _one_line_each(cls, value: list[str]) -> list[str]:
        for entry in value:
            _one_line(entry)
        return value

    @field_validator("install")
    @classmethod
    def _one_line_install(cls, value: str) -> str:
        return _one_line(value)

    def key(self) -> str:
        payload = json.dumps({"format": RECIPE_FORMAT, **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:20]

    @property
    def tag(self) -> str:
        return f"{ENV_REPOSITORY}:{self.key()}"


def _one_line(command: str) -> str:
    if "\n" in command or "\r" in command or "\x00" in command:
        raise ValueError(f"recipe command {command[:80]!r} holds a line break: give one command per list entry, "
                         "or join them with ';' or '&&'")
    return command


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
    """The build steps; the checkout is removed afterwards (sandboxes bring their own). Each step
    prints a mark first, so that a failed build names its step (`build_failure`)."""
    q = shlex.quote
    steps: list[tuple[str, str]] = []  # (what the mark says, the command)
    if recipe.python:
        # The base image is checked by major.minor: a recipe may name a patch release (3.11.7).
        want = ".".join(recipe.python.split(".")[:2])
        steps.append((f"check the base image has Python {want}",
                      f'have=$(python3 -c "import sys; print(\'%d.%d\' % sys.version_info[:2])"); '
                      f'case "$have" in {want}|{want}.*) ;; *) echo "recipe wants Python {recipe.python}, the base '
                      f'image has $have; pick a base_image with Python {want}" >&2; exit 3;; esac'))
    commands = list(recipe.pre_install)
    commands.append(f"python3 -m venv --system-site-packages {ENV_PREFIX}")  # ipykernel comes from the base
    commands.append(f". {ENV_PREFIX}/bin/activate")
    if recipe.pip_packages:
        commands.append("python -m pip install -q " + " ".join(q(p) for p in recipe.pip_packages))
    commands.append(f"cd {q(recipe.repo_dir)}")
    commands.append(recipe.install)
    commands.append(f"cd / && rm -rf {q(recipe.repo_dir)} /root/.cache")
    steps += [(command[:300], command) for command in commands]
    marked = [f"echo {q(f'{STEP_MARK}{n}/{len(steps)}: {label}')}; {command}"
              for n, (label, command) in enumerate(steps, 1)]
    script = "; \\\n    ".join(marked)
    return (
        f"FROM {recipe.base_image}\n"
        f"LABEL rollstream.env.key={recipe.key()} rollstream.env.repo={recipe.repo}@{recipe.commit}\n"
        f"COPY repo {recipe.repo_dir}\n"
        # One stream for the whole step: the builder passes a RUN's stdout and stderr on through
        # separate pipes, so an error could come out before the mark of the step that wrote it.
        f"RUN set -e; exec 2>&1; {script}\n"
        f"ENV PATH={ENV_PREFIX}/bin:{STANDARD_PATH} VIRTUAL_ENV={ENV_PREFIX}\n"
    )


def build_failure(tag: str, output: str, tail_lines: int = 20) -> str:
    """What went wrong in a failed build (`output`: the builder's stdout and stderr as they came), in
    the failing step's own words: the step its last mark names, the engine's verdict, and the step's
    last lines of output, without the builder's notices (podman's legacy-builder deprecation)."""
    notices = ("DEPRECATED:", "BuildKit is currently disabled", "environment-variable.", "Install the buildx")
    lines = [line for line in output.splitlines() if not line.strip().startswith(notices)]
    verdicts = [i for i, line in enumerate(lines) if "building at STEP" in line or "returned a non-zero code" in line]
    verdict = lines[verdicts[-1]] if verdicts else ""
    lines = [line for i, line in enumerate(lines) if i not in verdicts]
    marks = [i for i, line in enumerate(lines) if line.startswith(STEP_MARK)]
    if marks:
        step = lines[marks[-1]][len(STEP_MARK):]
        said = lines[marks[-1] + 1:]
    else:
        engine_steps = [i for i, line in enumerate(lines) if line.startswith(("STEP ", "Step "))]
        step = lines[engine_steps[-1]] if engine_steps else "(before the first step)"
        said = lines[engine_steps[-1] + 1:] if engine_steps else lines
    said = [line for line in said if line.strip() and not line.startswith(("COMMIT ", "--> "))][-tail_lines:]
    status = re.search(r"(exit status \d+|non-zero code: \d+)", verdict)
    shown = "\n".join(f"    {line}" for line in said) or "    (no output)"
    return (f"building {tag} failed at step {step}" + (f" ({status.group(1)})" if status else "")
            + f"; its last output:\n{shown}")


def _engine_is_podman() -> bool:
    components = docker("version", "--format", "{{range .Server.Components}}{{.Name}};{{end}}", check=False, timeout=60)
    return "Podman" in components.stdout


def build_argv(containerfile_path: str, tag: str, context: str, network: str, podman: str | None) -> list[str]:
    """The build command. podman's Docker API ignores a build's network (its builds reached the host's
    loopback even with --network none), so with podman as the engine its own CLI builds, with OCI
    isolation (chroot isolation would share the host's network) into the same image store."""
    if podman is not None:
        return [podman, "build", "--isolation", "oci", "--network", "none" if network == "none" else "private",
                "--file", containerfile_path, "--tag", tag, context]
    docker_binary = shutil.which("docker") or "docker"
    return [docker_binary, "build", "--network", network, "--file", containerfile_path, "--tag", tag, context]


def _build(context: str, tag: str, network: str) -> None:
    podman = shutil.which("podman") if _engine_is_podman() else None
    argv = build_argv(os.path.join(context, "Containerfile"), tag, context, network, podman)
    # The legacy builder for Docker: podman's Docker API serves it, and it needs no buildx plugin.
    env = {**os.environ, **client_env(), "DOCKER_BUILDKIT": "0"}
    if podman is not None:
        env.pop("BUILDAH_ISOLATION", None)
    result = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600, env=env)
    if result.returncode != 0:
        raise EnvBuildFailed(build_failure(tag, result.stdout))
    if not image_exists(tag):
        raise EnvBuildFailed(f"podman built {tag}, but the engine at DOCKER_HOST does not list it: the podman CLI "
                             "and the API socket use different image stores; run 'podman system service' as the "
                             "user that builds (scripts/install-podman does, as root)")


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
                    images_dir: str | None = None, network: str | None = None, force: bool = False) -> BuiltEnv:
    """Build the recipe's image unless cached, then the rootfs/SIF `backends` ask for.

    network: 'default' (the engine's private network) or 'none'; None reads build_network()."""
    network = network or build_network()
    if network not in BUILD_NETWORKS:
        raise ValueError(f"an environment build runs on one of {BUILD_NETWORKS}, not {network!r}")
    started = time.monotonic()
    tag = recipe.tag
    built = False
    if force or not image_exists(tag):
        with tempfile.TemporaryDirectory(prefix="rs-envbuild-", dir=os.environ.get("TMPDIR", "/var/tmp")) as context:
            _checkout(mirror_entry, recipe.commit, os.path.join(context, "repo"))
            with open(os.path.join(context, "Containerfile"), "w") as handle:
                handle.write(containerfile(recipe))
            log.info("building %s for %s@%s (network %s)", tag, recipe.repo, recipe.commit[:12], network)
            _build(context, tag, network)
        built = True
    result = BuiltEnv(recipe.key(), tag, built, 0.0)
    if "bwrap" in backends:
        result.rootfs_made = built or force or not os.path.isdir(rootfs_path(tag, images_dir))
        result.rootfs = export_rootfs(tag, images_dir, force=built or force)
    if "singularity" in backends:
        result.sif = sif_from_engine_image(tag, images_dir, force=built or force)
    result.build_s = time.monotonic() - started
    return result
