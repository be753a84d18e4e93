"""Harness presets: a declarative TOML file per harness that runs as a command inside the job's
sandbox (agent/sandbox_harness.py runs it). A preset says how the harness is installed into an
environment image (a PyPI package at a pinned version in a venv of its own, or an npm package at a
pinned version with a Node.js of its own from the npm registry; once, when the image is built), its
command line, the environment and files that point it at the job's door, the API
it speaks, and where its answer is. Shipped presets live in rollstream/data/harnesses/; an
operator adds folders of their own (``harness_preset_dirs``). No preset holds code."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.errors import InvalidJob

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "data" / "harnesses"
IMAGE_REPOSITORY = "localhost/rollstream/harness"
LABEL = "rollstream.harness"
# What the door serves; a preset's `api` is one of them.
APIS = ("openai-chat", "openai-responses", "anthropic-messages")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_PIN = re.compile(r"^[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+$")
_NPM_PIN = re.compile(r"^((@[a-z0-9._-]+/)?[a-z0-9._-]+)@(\d+\.\d+\.\d+([-+][A-Za-z0-9.-]+)?)$")
# The Node.js an npm preset runs on, from the npm registry's node-linux-<arch> package (the `node`
# package's binaries): the CLIs want >= 22 (their `engines`), Debian 12's nodejs is 18. The host's
# npm only installs; the sandbox runs this node, from the preset's prefix.
NODE_VERSION = "22.23.3"
NPM_MARKER = ".rollstream-npm-installed"


class PresetError(ValueError):
    """A preset file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class PresetFile:
    """A file written into the sandbox before the harness starts (a config it reads)."""

    path: str
    content: str
    mode: int = 0o644


@dataclass(frozen=True)
class Preset:
    name: str
    source: Path
    description: str
    api: str
    package: str | None  # "name==version" (PyPI), pins apart by spaces; None: nothing to install (in the image)
    prefix: str  # the venv the package is installed into, inside the image (and on a bwrap host)
    argv: list[str]
    env: dict[str, str]
    files: list[PresetFile] = field(default_factory=list)
    answer_file: str | None = None  # where the harness leaves its answer; else its output's last line
    answer_json_key: str | None = None  # dotted key of the answer in that file when it is JSON
    python: str = "python3"  # the interpreter the venv is made from (in the image)
    driver: str | None = None  # a runner shipped in rollstream (driver_source) copied in as {driver}
    npm: str | None = None  # "name@version" (npm), installed with its own node into prefix
    node: str = NODE_VERSION  # that node's version (npm presets)
    # The folder of ``python`` on this host, for a package that needs a Python the base image lacks
    # (OpenHands: >= 3.12 on Debian 12's 3.11): its image copies in that folder and the host's venv.
    python_home: str | None = None

    @property
    def copies_host_install(self) -> bool:
        """Its image copies this host's install in (npm presets; PyPI ones on a Python of the host's)."""
        return self.npm is not None or self.python_home is not None

    @property
    def version(self) -> str:
        if self.npm:
            return self.npm.rsplit("@", 1)[1]
        return self.package.split()[0].split("==", 1)[1] if self.package else "-"

    @property
    def installs(self) -> str | None:
        """What the preset installs, as its file pins it (None: nothing)."""
        return self.package or self.npm

    @property
    def installed_name(self) -> str:
        """The bare name of the package it installs (its own name when it installs nothing)."""
        if self.npm:
            return self.npm.rsplit("@", 1)[0].rsplit("/", 1)[-1]  # @openai/codex@0.169.0: codex
        return self.package.split()[0].split("==", 1)[0].lower() if self.package else self.name

    def image_tag(self, base_image: str) -> str:
        """The environment image holding this preset's install on top of ``base_image``: named by
        what it installs, so presets of one install (a variant with other options) share it."""
        pins = f"{self.package}\n{self.prefix}" + (f"\n{self.npm}\nnode {self.node}" if self.npm else "")
        pins += f"\n{self.python} in {self.python_home}" if self.python_home else ""
        digest = hashlib.sha256(f"{base_image}\n{pins}".encode()).hexdigest()[:12]
        return f"{IMAGE_REPOSITORY}:{self.installed_name}-{self.version}-{digest}"

    def install_commands(self) -> list[str]:
        """The shell commands that install the preset into an image (or this host)."""
        q = shlex.quote
        if self.npm is not None:
            return npm_install_commands(self.npm, self.node, self.prefix)
        if self.package is None:
            return []
        pins = " ".join(q(pin) for pin in self.package.split())
        return [f"{q(self.python)} -m venv {q(self.prefix)}",
                f"{q(self.prefix)}/bin/pip install --no-cache-dir --disable-pip-version-check -q {pins}"]

    def containerfile(self, base_image: str) -> str:
        if self.installs is None:
            raise PresetError(f"{self.source}: this preset installs nothing ([install] has no 'pypi' or 'npm'); its "
                              "command must be in the image already")
        if self.copies_host_install:  # the host's install, copied in (build_image puts it in the context)
            return (f"FROM {base_image}\n"
                    f"LABEL {LABEL}.{self.installed_name}={self.version}\n"
                    + (f"COPY {PYTHON_CONTEXT_DIR} {self.python_home}\n" if self.python_home else "")
                    + f"COPY {NPM_CONTEXT_DIR} {self.prefix}\n")
        return (f"FROM {base_image}\n"
                f"LABEL {LABEL}.{self.installed_name}={self.version}\n"
                f"RUN set -e; {' && '.join(self.install_commands())}\n")

    def installed_on_host(self) -> bool:
        if self.npm is not None:
            try:
                if Path(self.prefix, NPM_MARKER).read_text() != npm_marker(self.npm, self.node):
                    return False
            except OSError:
                return False
        elif self.package is not None and not os.path.isfile(os.path.join(self.prefix, "pyvenv.cfg")):
            return False
        command = self.argv[0]
        return os.path.exists(command) if command.startswith("/") else shutil.which(command) is not None


NPM_CONTEXT_DIR = "prefix"  # the host's install (an npm prefix, a copied venv) in its image build's context
PYTHON_CONTEXT_DIR = "python-home"  # the host's interpreter folder of a preset with install.python_home


def node_package(version: str) -> str:
    """The npm registry's package of Node.js binaries for this machine (what the `node` package installs)."""
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    if arch is None:
        raise PresetError(f"no Node.js binaries on the npm registry for {platform.machine()}")
    return f"node-linux-{arch}@{version}"


def npm_marker(npm: str, node: str) -> str:
    return f"{npm}\nnode {node}\n"


def npm_install_commands(npm: str, node: str, prefix: str) -> list[str]:
    """Node first, then the package with that node first on PATH (its install scripts need a node
    its `engines` accept), into a folder beside the prefix, renamed into place when complete: a
    failed or interrupted install leaves no half prefix. The host's npm only fetches."""
    q = shlex.quote
    staging = f"{prefix}.installing"
    npm_args = "--no-audit --no-fund --no-update-notifier --loglevel=error --omit=dev"
    return [f"rm -rf {q(staging)} && mkdir -p {q(staging)}",
            f"npm install --prefix {q(staging)} {npm_args} {q(node_package(node))}",
            f"PATH={q(staging)}/node_modules/.bin:$PATH npm install --prefix {q(staging)} {npm_args} {q(npm)}",
            f"printf %s {q(npm_marker(npm, node))} > {q(staging)}/{NPM_MARKER}",
            f"rm -rf {q(prefix)} && mv {q(staging)} {q(prefix)}"]


def _text(data: dict, key: str, source: Path, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise PresetError(f"{source}: '{key}' must be a non-empty string")
    return value


def load_preset(path: Path) -> Preset:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PresetError(f"{path}: not a readable TOML preset ({exc})") from exc
    name = _text(data, "name", path)
    assert name is not None
    if not _NAME.match(name) or path.stem != name:
        raise PresetError(f"{path}: name {name!r} must be the file's own name (lower case, digits, '.-_')")
    api = _text(data, "api", path)
    if api not in APIS:
        raise PresetError(f"{path}: api {api!r} is not served by the door; use one of {', '.join(APIS)}")
    install, run = data.get("install") or {}, data.get("run") or {}
    pins = install.get("pypi")
    pins = [pins] if isinstance(pins, str) else pins
    if pins is not None and (not isinstance(pins, list) or not pins
                             or not all(isinstance(pin, str) and _PIN.match(pin) for pin in pins)):
        raise PresetError(f"{path}: install.pypi {pins!r} must pin one version, e.g. 'mini-swe-agent==2.4.6' (or be a "
                          "list of such pins, installed together into one venv)")
    package = " ".join(pins) if pins else None
    npm = _text(install, "npm", path, required=False)
    if npm is not None and (package is not None or not _NPM_PIN.match(npm)):
        raise PresetError(f"{path}: install.npm {npm!r} must pin one version, e.g. '@openai/codex@0.169.0' (and "
                          "a preset installs from one registry: 'pypi' or 'npm')")
    node = _text(install, "node", path, required=False) or NODE_VERSION
    python = _text(install, "python", path, required=False) or "python3"
    python_home = _text(install, "python_home", path, required=False)
    if python_home is not None and (package is None or not python_home.startswith("/")
                                    or not python.startswith(python_home.rstrip("/") + "/")):
        raise PresetError(f"{path}: install.python_home {python_home!r} must be the absolute folder that holds "
                          f"install.python ({python!r}) of a PyPI preset")
    if not re.match(r"^\d+\.\d+\.\d+$", node):
        raise PresetError(f"{path}: install.node {node!r} must be one Node.js version, e.g. '{NODE_VERSION}'")
    prefix = _text(install, "prefix", path, required=package is not None or npm is not None) or "/"
    if not prefix.startswith("/") or ".." in prefix.split("/"):
        raise PresetError(f"{path}: install.prefix must be an absolute path without '..'")
    argv = run.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise PresetError(f"{path}: run.argv must be a list of strings (the command line)")
    env = run.get("env") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise PresetError(f"{path}: run.env must map names to strings")
    files = []
    for entry in data.get("files") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) \
                or not isinstance(entry.get("content"), str):
            raise PresetError(f"{path}: each [[files]] needs 'path' and 'content' strings")
        files.append(PresetFile(entry["path"], entry["content"], int(entry.get("mode", 0o644))))
    driver = _text(run, "driver", path, required=False)
    if driver is not None and not driver_source(driver).is_file():
        raise PresetError(f"{path}: run.driver {driver!r} is none of rollstream's runners "
                          f"({', '.join(sorted(p.name[:-len('_runner.py')] for p in DRIVER_DIR.glob('*_runner.py')))})")
    answer = data.get("answer") or {}
    return Preset(name=name, source=path, description=str(data.get("description", "")), api=api, package=package,
                  prefix=prefix, argv=[a.replace("{prefix}", prefix) for a in argv],
                  env={k: v.replace("{prefix}", prefix) for k, v in env.items()}, files=files,
                  answer_file=_text(answer, "file", path, required=False),
                  answer_json_key=_text(answer, "json_key", path, required=False),
                  python=python, npm=npm, node=node, driver=driver, python_home=python_home)


# Runners for harnesses that are libraries without a command line of their own (the OpenHands SDK):
# a preset names one (run.driver) rather than holding code; the run stage copies it into the sandbox.
DRIVER_DIR = Path(__file__).resolve().parent / "harnesses"


def driver_source(name: str) -> Path:
    return DRIVER_DIR / f"{name if re.fullmatch(r'[a-z0-9_]+', name) else '-'}_runner.py"


def preset_dirs(extra: list[Path] | None = None) -> list[Path]:
    """Where presets are found: the operator's folders first (their preset of a name wins), then ours."""
    return [*(extra or []), BUILTIN_DIR]


def all_presets(extra: list[Path] | None = None) -> dict[str, Preset]:
    found: dict[str, Preset] = {}
    for folder in preset_dirs(extra):
        for path in sorted(Path(folder).glob("*.toml")):
            found.setdefault(path.stem, load_preset(path))
    return found


def find_preset(name: str, extra: list[Path] | None = None) -> Preset | None:
    """The preset ``name``, or None when no preset of that name exists (a Python harness may)."""
    if not _NAME.match(name):
        return None
    for folder in preset_dirs(extra):
        path = Path(folder) / f"{name}.toml"
        if path.is_file():
            try:
                return load_preset(path)
            except PresetError as exc:
                raise InvalidJob(str(exc)) from exc
    return None


def install_on_host(preset: Preset) -> str:
    """Install ``preset`` into its prefix on this host (what bwrap sandboxes on the host's own
    root see); returns the prefix. Nothing happens when it is there already."""
    if preset.installed_on_host() or preset.installs is None:
        return preset.prefix
    if preset.npm is not None and shutil.which("npm") is None:
        raise RuntimeError(f"installing {preset.npm} needs npm on this host (Debian: apt-get install npm; it only "
                           f"fetches: the harness runs on node {preset.node}, installed with it)")
    for command in preset.install_commands():
        completed = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=3600,
                                   check=False)
        if completed.returncode != 0:
            raise RuntimeError(f"installing {preset.installs} into {preset.prefix} failed at `{command}`:\n"
                               f"{(completed.stderr or completed.stdout)[-3000:]}")
    return preset.prefix


def build_image(preset: Preset, base_image: str, force: bool = False) -> str:
    """Build (once; again with ``force``: ``base_image`` was rebuilt under its tag) the environment
    image with ``preset`` installed on ``base_image``; its tag."""
    import tempfile

    from rollstream.sandboxes.env_images import _build, build_network, image_exists

    tag = preset.image_tag(base_image)
    if image_exists(tag) and not force:
        return tag
    with tempfile.TemporaryDirectory(prefix="rs-harness-") as context:
        Path(context, "Containerfile").write_text(preset.containerfile(base_image))
        if preset.copies_host_install:  # built on this host (once), copied in: the image needs no npm (nor a 3.12)
            install_on_host(preset)
            _copy_tree(preset.prefix, os.path.join(context, NPM_CONTEXT_DIR))
            if preset.python_home:
                _copy_tree(preset.python_home, os.path.join(context, PYTHON_CONTEXT_DIR))
        _build(context, tag, build_network())
    return tag


def _copy_tree(source: str, destination: str) -> None:
    """Hard links where the two share a filesystem (hundreds of MB of binaries), else a copy."""
    for argv in (["cp", "-al", source, destination], ["cp", "-a", source, destination]):
        shutil.rmtree(destination, ignore_errors=True)
        if subprocess.run(argv, capture_output=True, timeout=600, check=False).returncode == 0:
            return
    raise RuntimeError(f"cannot copy {source} into the image's build context at {destination}")


def images_with(preset: Preset) -> list[str]:
    """The local engine's images that hold ``preset``'s install (by the label the build gives them)."""
    binary = shutil.which("docker")
    if binary is None:
        return []
    from rollstream.sandboxes.backends.docker import client_env

    completed = subprocess.run(
        [binary, "images", "--filter", f"label={LABEL}.{preset.installed_name}={preset.version}", "--format",
         "{{.Repository}}:{{.Tag}}"], capture_output=True, text=True, timeout=60, env={**os.environ, **client_env()},
        check=False)
    if completed.returncode != 0:
        return []
    return sorted({line.strip() for line in completed.stdout.splitlines() if line.strip() and "<none>" not in line})


def describe(preset: Preset) -> dict[str, Any]:
    """What `rollstream harnesses list` shows of a preset."""
    return {"name": preset.name, "package": preset.installs, "node": preset.node if preset.npm else None,
            "api": preset.api, "file": str(preset.source), "prefix": preset.prefix,
            "host": preset.installed_on_host(), "images": images_with(preset), "description": preset.description}
