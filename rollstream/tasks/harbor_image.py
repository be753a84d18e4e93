"""A Harbor task's environment image: ``environment/Dockerfile`` built once with the container
engine (podman or Docker, through env_images.py's build command), cached by the content of the
environment folder, the same image for the Docker backend and a rootfs exported from it for
bubblewrap (images.py).

No registry answers here, so each ``FROM`` is first mapped (Settings.harbor_base_images: python,
debian and ubuntu to the locally built base image by default). A second, tiny build on top
records what a sandbox needs: the workdir's files as the Dockerfile left them
(/opt/rs-harbor/workdir.tar, unpacked into each sandbox's own workdir, which hides the image's)
and /logs, /tests and /solution as links into the sandbox's private /tmp, where Harbor's verifier
paths must be writable on a read-only rootfs.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from rollstream.sandboxes.backends.docker import client_env
from rollstream.sandboxes.env_images import (
    EnvBuildFailed,
    build_argv,
    build_failure,
    build_network,
    docker,
    image_exists,
)
from rollstream.sandboxes.image_cache import default_images_dir, rootfs_path
from rollstream.sandboxes.images import export_rootfs, images_folder
from rollstream.tasks.harbor_folder import TaskFolder

log = logging.getLogger(__name__)

HARBOR_FORMAT = 1  # bump when the build steps change, so old images are not reused
REPOSITORY = "localhost/rollstream/harbor"
SOURCE_REPOSITORY = "localhost/rollstream/harbor-src"
STATE_DIR = "/tmp/.rs-harbor"  # the sandbox's private /tmp: /logs, /tests and /solution point here
WORKDIR_TAR = "/opt/rs-harbor/workdir.tar"
LINKED = ("logs", "tests", "solution")
DEFAULT_WORKDIR = "/app"  # Terminal-Bench's, where a Dockerfile sets none
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_STAGE_NAME = re.compile(r"\bAS\s+(\S+)", re.IGNORECASE)
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_PATH = re.compile(r"(?:/[A-Za-z0-9_.@+-]+)+")

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
# key -> (when, why) its build failed: the jobs of a broken task that come soon after do not
# rebuild it; past FAILED_BUILD_MEMO_S one tries again (a package index that was down, say).
_failed: dict[str, tuple[float, str]] = {}
FAILED_BUILD_MEMO_S = 300.0
_keys: dict[str, tuple[tuple, tuple[str, str, list[tuple[str, str]]]]] = {}  # folder -> (signature, key)
KEY_MEMO_ENTRIES = 4096


def map_image(reference: str, mapping: dict[str, str]) -> str:
    """What ``reference`` is built from here: the first glob of ``mapping`` it matches (written
    without docker.io/library/), else itself."""
    short = reference
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "library/"):
        if short.startswith(prefix):
            short = short[len(prefix):]
            break
    for pattern, target in mapping.items():
        if fnmatch.fnmatchcase(short, pattern):
            return target
    return reference


def map_dockerfile(text: str, mapping: dict[str, str]) -> tuple[str, list[tuple[str, str]]]:
    """The Dockerfile with each FROM's image mapped (earlier stages' names and ARG-built
    references stay as written); returns it and the (original, mapped) pairs."""
    stages: set[str] = set()
    mapped: list[tuple[str, str]] = []
    lines = []
    for line in text.splitlines():
        match = _FROM.match(line)
        if match:
            head, flags, image, rest = match.groups()
            name = _STAGE_NAME.search(rest)
            if image.lower() not in stages and "$" not in image:
                target = map_image(image, mapping)
                if target != image:
                    mapped.append((image, target))
                    line = f"{head}{flags}{target}{rest}"
            if name:
                stages.add(name.group(1).lower())
        lines.append(line)
    return "\n".join(lines) + "\n", mapped


def finishing_containerfile(source_tag: str, workdir: str, user: str) -> str:
    """The second build: the workdir's files kept aside, Harbor's paths linked into /tmp."""
    q = shlex.quote
    links = "; ".join(f"rm -rf /{name}; ln -s {STATE_DIR}/{name} /{name}" for name in LINKED)
    script = (f"set -e; mkdir -p {os.path.dirname(WORKDIR_TAR)}; if [ -d {q(workdir)} ]; then "
              f"tar -C {q(workdir)} -cf {WORKDIR_TAR} .; else tar -cf {WORKDIR_TAR} --files-from /dev/null; fi; "
              f"{links}")
    return (f"FROM {source_tag}\nUSER root\nRUN {script}\n"
            f"LABEL rollstream.harbor.workdir={workdir}\n" + (f"USER {user}\n" if user else ""))


@dataclass
class HarborImage:
    """A built environment: the engine's tag (Docker), the sandbox workdir, the rootfs (bwrap)."""

    key: str
    tag: str
    workdir: str
    user: str = ""
    rootfs: str | None = None
    built: bool = False
    mapped: list[tuple[str, str]] | None = None
    # The image's ENV (its Dockerfile's and its base's): a container gets it from the engine, a
    # bwrap sandbox from the task's sandbox spec. None for an image recorded before it was kept.
    env: dict[str, str] | None = None


def image_key(folder: TaskFolder, mapping: dict[str, str]) -> tuple[str, str, list[tuple[str, str]]]:
    """The content key of the folder's environment (its files, the mapped Dockerfile, this
    module's build format), the mapped Dockerfile and what was mapped. Each stage asks for it:
    the folder is read and hashed again only when a file's size, time or inode changed."""
    signature = (_stat_signature(os.path.join(folder.path, "environment")), tuple(sorted(mapping.items())))
    known = _keys.get(folder.path)
    if known is not None and known[0] == signature:
        return known[1]
    files = folder.files("environment")
    dockerfile, mapped = map_dockerfile(files.files["Dockerfile"][0].decode("utf-8", "replace"), mapping)
    sha = hashlib.sha256(f"harbor-format-{HARBOR_FORMAT}\0".encode())
    sha.update(files.digest().encode())
    sha.update(dockerfile.encode())
    result = (sha.hexdigest()[:20], dockerfile, mapped)
    if len(_keys) > KEY_MEMO_ENTRIES:
        _keys.clear()
    _keys[folder.path] = (signature, result)
    return result


def _stat_signature(top: str) -> tuple:
    """What changes when any entry beneath ``top`` does (symlinks not followed)."""
    entries = []
    for parent, folders, names in os.walk(top):
        for name in sorted(folders + names):
            info = os.lstat(os.path.join(parent, name))
            entries.append((os.path.relpath(os.path.join(parent, name), top), info.st_mode, info.st_size,
                            info.st_mtime_ns, info.st_ctime_ns, info.st_ino))
        folders.sort()
    return tuple(entries)


def _meta_path(key: str, images_dir: str | None) -> str:
    return os.path.join(images_dir or default_images_dir(), f"harbor-{key}.json")


def cached(key: str, images_dir: str | None = None) -> HarborImage | None:
    """The image of ``key`` as recorded when it was built, or None."""
    try:
        with open(_meta_path(key, images_dir), encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None
    return HarborImage(**{k: v for k, v in data.items() if k in HarborImage.__dataclass_fields__})


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def ensure_image(folder: TaskFolder, mapping: dict[str, str], rootfs: bool, images_dir: str | None = None,
                 network: str | None = None) -> HarborImage:
    """The folder's environment image, built unless cached (once per key on this node, also
    across processes), and its rootfs when ``rootfs``. Raises EnvBuildFailed naming the failing
    step when the Dockerfile does not build."""
    key, dockerfile, mapped = image_key(folder, mapping)
    failed = _failed.get(key)
    if failed is not None and time.monotonic() - failed[0] < FAILED_BUILD_MEMO_S:
        raise EnvBuildFailed(failed[1])
    import fcntl

    with _lock(key):
        folder_path = images_folder(images_dir)
        with open(os.path.join(folder_path, f"harbor-{key}.lock"), "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            image = cached(key, images_dir)
            if image is None or not image_exists(image.tag):
                try:
                    image = _build(folder, key, dockerfile, network or build_network())
                except EnvBuildFailed as failure:
                    _failed[key] = (time.monotonic(), str(failure))
                    raise
                image.mapped = mapped
            if rootfs and (image.built or image.rootfs is None or not os.path.isdir(image.rootfs)):
                image.rootfs = export_rootfs(image.tag, images_dir, force=image.built)
            with open(_meta_path(key, images_dir) + ".new", "w", encoding="utf-8") as handle:
                json.dump({**asdict(image), "built": False}, handle)
            os.replace(_meta_path(key, images_dir) + ".new", _meta_path(key, images_dir))
    return image


def _engine_is_podman() -> bool:
    components = docker("version", "--format", "{{range .Server.Components}}{{.Name}};{{end}}", check=False, timeout=60)
    return "Podman" in components.stdout


def run_build(context: str, containerfile: str, tag: str, network: str, timeout_s: float) -> None:
    podman = shutil.which("podman") if _engine_is_podman() else None
    argv = build_argv(containerfile, tag, context, network, podman)
    env = {**os.environ, **client_env(), "DOCKER_BUILDKIT": "0"}
    if podman is not None:
        env.pop("BUILDAH_ISOLATION", None)
    try:
        result = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode("utf-8", "replace") if isinstance(expired.stdout, bytes) else expired.stdout or ""
        raise EnvBuildFailed(f"building {tag} took longer than the task's build_timeout_sec ({timeout_s:g} s); "
                             f"its last output:\n{out[-1500:]}") from None
    if result.returncode != 0:
        raise EnvBuildFailed(build_failure(tag, result.stdout))


def _build(folder: TaskFolder, key: str, dockerfile: str, network: str) -> HarborImage:
    source, tag = f"{SOURCE_REPOSITORY}:{key}", f"{REPOSITORY}:{key}"
    timeout_s = folder.config.environment.build_timeout_sec
    with tempfile.TemporaryDirectory(prefix="rs-harbor-", dir=os.environ.get("TMPDIR", "/var/tmp")) as context:
        folder.files("environment").write_to(context)
        with open(os.path.join(context, "Dockerfile"), "w", encoding="utf-8") as handle:
            handle.write(dockerfile)
        log.info("building %s for harbor task %s (network %s)", source, folder.path, network)
        run_build(context, os.path.join(context, "Dockerfile"), source, network, timeout_s)
    config = json.loads(docker("image", "inspect", "--format", "{{json .Config}}", source, timeout=60).stdout)
    workdir = os.path.normpath(config.get("WorkingDir") or "/")
    if workdir == "/":
        workdir = DEFAULT_WORKDIR
    if not _PLAIN_PATH.fullmatch(workdir) or workdir.split("/")[1] in ("tmp", "proc", "dev", "run", "sys"):
        raise EnvBuildFailed(f"the Dockerfile of {folder.path} sets WORKDIR {workdir!r}; a sandbox's workdir is a "
                             "plain absolute path outside /tmp, /proc, /dev, /run and /sys")
    user = str(config.get("User") or "")
    if user and not _USER.fullmatch(user):
        raise EnvBuildFailed(f"the Dockerfile of {folder.path} sets USER {user!r}, not a plain user name or uid")
    with tempfile.TemporaryDirectory(prefix="rs-harbor-", dir=os.environ.get("TMPDIR", "/var/tmp")) as context:
        path = os.path.join(context, "Containerfile")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(finishing_containerfile(source, workdir, user))
        run_build(context, path, tag, "none", timeout_s)
    return HarborImage(key=key, tag=tag, workdir=workdir, user=user, built=True, env=image_env(config))


def image_env(config: dict) -> dict[str, str]:
    """``Config.Env`` of an image inspection as a mapping (names as the shell takes them)."""
    env = {}
    for item in config.get("Env") or ():
        name, sep, value = str(item).partition("=")
        if sep and _ENV_NAME.fullmatch(name):
            env[name] = value
    return env


def rootfs_of(image: HarborImage, images_dir: str | None = None) -> str:
    return image.rootfs or rootfs_path(image.tag, images_dir)
