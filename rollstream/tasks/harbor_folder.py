"""A Harbor task folder (Terminal-Bench 2 and Harbor's benchmark adapters) read from the host:
``task.toml`` (timeouts, resources), ``instruction.md`` (what the agent is told),
``environment/Dockerfile`` (built by harbor_image.py), ``tests/test.sh`` (the verifier, which
writes /logs/verifier/reward.txt or reward.json) and optionally ``solution/solve.sh``.

A folder comes from a job, so it is read as hostile: it must lie beneath a folder the operator
allows (``harbor_task_roots``, symlinks resolved), and every file is opened beneath its folder's
descriptor without following a symlink; a symlink, FIFO or device in the folder fails the job.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.config import Settings, load_settings
from rollstream.errors import InvalidJob

ROOTS_SETTING = "harbor_task_roots (ROLLSTREAM_HARBOR_TASK_ROOTS, a JSON list)"
TEXT_MAX_BYTES = 1 << 20  # task.toml, instruction.md
FOLDER_MAX_BYTES = 512 << 20  # environment/, tests/, solution/ each
FOLDER_MAX_FILES = 50_000
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
_NO_FOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class HarborTaskRefused(InvalidJob):
    """The task folder cannot run here: outside the allowed roots, malformed, or unsupported."""


# -- task.toml -----------------------------------------------------------------------------
class VerifierConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout_sec: float = Field(600.0, gt=0, le=24 * 3600)
    env: dict[str, str] = Field(default_factory=dict)


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    timeout_sec: float | None = Field(None, gt=0, le=7 * 24 * 3600)


def _size_mb(value: str) -> int:
    """Harbor's deprecated size strings: '2G', '512M', '1024K'."""
    text = value.strip().upper()
    units = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    if not text or text[-1] not in units:
        raise ValueError(f"size {value!r} is not like '2G' or '512M'")
    return int(float(text[:-1]) * units[text[-1]])


class EnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    build_timeout_sec: float = Field(600.0, gt=0, le=24 * 3600)
    cpus: float = Field(1, gt=0)
    memory_mb: int = Field(2048, gt=0)
    storage_mb: int = Field(10240, gt=0)
    memory: str | None = None  # deprecated spellings of memory_mb / storage_mb
    storage: str | None = None
    docker_image: str | None = None
    # Harbor's default is true: a task that leaves it out may use the network without saying so.
    allow_internet: bool = True

    @model_validator(mode="after")
    def _deprecated_sizes(self) -> EnvironmentConfig:
        if self.memory is not None:
            self.memory_mb = _size_mb(self.memory)
        if self.storage is not None:
            self.storage_mb = _size_mb(self.storage)
        return self


class HarborConfig(BaseModel):
    """The parts of Harbor's task.toml that rollstream honours; other sections are ignored."""

    model_config = ConfigDict(extra="ignore")
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    metadata: dict = Field(default_factory=dict)


# -- where a folder may be -----------------------------------------------------------------
@dataclass(frozen=True)
class TaskRoots:
    """The folders beneath which a job's task folder may lie (the operator's ``harbor_task_roots``)."""

    roots: tuple[Path, ...]
    kind: str = "harbor"  # the task whose folders these are, and the setting that lists them
    setting: str = ROOTS_SETTING

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> TaskRoots:
        return cls(tuple((settings or load_settings()).harbor_task_roots))

    def check(self, path: object) -> str:
        """The folder's real path if ``path`` is an absolute path beneath an allowed root, else
        HarborTaskRefused saying what to do."""
        kind = self.kind
        if not isinstance(path, str) or not path or "\x00" in path:
            raise HarborTaskRefused(f"{kind}: the instance's path must be the task folder's absolute path (a string)")
        if not os.path.isabs(path):
            raise HarborTaskRefused(f"{kind}: path {path!r} is relative; give the task folder's absolute path")
        real = os.path.realpath(path)
        for root in self.roots:
            top = os.path.realpath(root)
            if top != "/" and (real == top or real.startswith(top.rstrip("/") + "/")):
                return real
        raise HarborTaskRefused(f"{kind}: task folder {path!r} is not beneath a folder the operator allows "
                                f"({', '.join(map(str, self.roots)) or 'none configured'}); put it there, or ask the "
                                f"operator to add its parent to {self.setting}")


# -- reading without following symlinks ----------------------------------------------------
def _open_folder(parent: int | None, name: str, what: str) -> int:
    try:
        return os.open(name, _NO_FOLLOW | os.O_DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        raise HarborTaskRefused(f"harbor: the task folder has no {what}") from None
    except OSError as error:
        raise HarborTaskRefused(f"harbor: {what} cannot be opened as a folder ({error.strerror}); symlinks "
                                "are not followed") from None


def _read_file(parent: int, name: str, what: str, max_bytes: int) -> bytes:
    try:
        fd = os.open(name, _NO_FOLLOW, dir_fd=parent)
    except FileNotFoundError:
        raise HarborTaskRefused(f"harbor: the task folder has no {what}") from None
    except OSError as error:
        raise HarborTaskRefused(f"harbor: {what} cannot be opened ({error.strerror}); symlinks are not "
                                "followed") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise HarborTaskRefused(f"harbor: {what} is not a regular file")
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise HarborTaskRefused(f"harbor: {what} is larger than {max_bytes} bytes")
    return data


@dataclass
class FolderFiles:
    """The regular files of a folder (relative path -> (content, executable)), read beneath it."""

    files: dict[str, tuple[bytes, bool]]

    def tar(self) -> bytes:
        """A tar of the files (folders implied), for writing into a sandbox or a build context."""
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
            for path, (data, executable) in sorted(self.files.items()):
                member = tarfile.TarInfo(path)
                member.size, member.mode = len(data), 0o755 if executable else 0o644
                archive.addfile(member, io.BytesIO(data))
        return buffer.getvalue()

    def write_to(self, folder: str) -> None:
        for path, (data, executable) in self.files.items():
            target = os.path.join(folder, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(data)
            os.chmod(target, 0o755 if executable else 0o644)

    def digest(self) -> str:
        sha = hashlib.sha256()
        for path, (data, executable) in sorted(self.files.items()):
            sha.update(f"{path}\0{int(executable)}\0{len(data)}\0".encode())
            sha.update(data)
        return sha.hexdigest()


def read_folder(top: int, what: str, max_bytes: int = FOLDER_MAX_BYTES) -> FolderFiles:
    """Every regular file beneath the open folder ``top``; a symlink or special file refuses it."""
    found: dict[str, tuple[bytes, bool]] = {}
    total = 0

    def walk(fd: int, prefix: str, depth: int) -> None:
        nonlocal total
        if depth > 32:
            raise HarborTaskRefused(f"harbor: {what} nests folders deeper than 32")
        for name in sorted(os.listdir(fd)):
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            path = prefix + name
            if stat.S_ISDIR(info.st_mode):
                child = _open_folder(fd, name, f"{what}/{path}")
                try:
                    walk(child, path + "/", depth + 1)
                finally:
                    os.close(child)
            elif stat.S_ISREG(info.st_mode):
                total += info.st_size
                if total > max_bytes or len(found) >= FOLDER_MAX_FILES:
                    raise HarborTaskRefused(f"harbor: {what} holds more than {max_bytes >> 20} MiB or "
                                            f"{FOLDER_MAX_FILES} files")
                found[path] = (_read_file(fd, name, f"{what}/{path}", max_bytes), bool(info.st_mode & 0o111))
            else:
                kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "a special file"
                raise HarborTaskRefused(f"harbor: {what}/{path} is {kind}; a task folder holds regular files "
                                        "and folders only")

    walk(top, "", 0)
    return FolderFiles(found)


@dataclass
class TaskFolder:
    """A task folder as read: its config, instruction and the digest of its environment folder."""

    path: str  # the real path, beneath an allowed root
    name: str
    config: HarborConfig
    instruction: str

    @classmethod
    def load(cls, path: object, roots: TaskRoots | None = None) -> TaskFolder:
        real = (roots or TaskRoots.from_settings()).check(path)
        top = _open_folder(None, real, f"folder {real}")
        try:
            try:
                config = HarborConfig.model_validate(tomllib.loads(
                    _read_file(top, "task.toml", "task.toml", TEXT_MAX_BYTES).decode("utf-8")))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError, ValidationError, ValueError) as error:
                raise HarborTaskRefused(f"harbor: {real}/task.toml is not a valid Harbor task.toml: {error}") from None
            instruction = _read_file(top, "instruction.md", "instruction.md", TEXT_MAX_BYTES).decode("utf-8", "replace")
            environment = _open_folder(top, "environment", "environment/ folder")
            try:
                names = set(os.listdir(environment))
            finally:
                os.close(environment)
            if "Dockerfile" not in names:
                compose = sorted(names & set(COMPOSE_FILES))
                raise HarborTaskRefused(
                    f"harbor: {real}/environment has {compose[0] + ' but ' if compose else ''}no Dockerfile; "
                    "rollstream builds the agent's container (a compose file's service main) from "
                    "environment/Dockerfile")
            tests = _open_folder(top, "tests", "tests/ folder")
            try:
                _read_file(tests, "test.sh", "tests/test.sh", FOLDER_MAX_BYTES)
            finally:
                os.close(tests)
        finally:
            os.close(top)
        return cls(real, os.path.basename(real), config, instruction)

    def _open(self, folder: str) -> int:
        """A descriptor of the task's ``folder``, opened beneath the task folder (never through a symlink)."""
        top = _open_folder(None, self.path, f"folder {self.path}")
        try:
            return _open_folder(top, folder, f"{folder}/ folder")
        finally:
            os.close(top)

    def file(self, folder: str, names: tuple[str, ...]) -> tuple[str, bytes] | None:
        """The first of ``names`` that ``folder`` holds, and its content (read beneath the task
        folder, never through a symlink), or None: one file, without reading the whole folder."""
        sub = self._open(folder)
        try:
            present = set(os.listdir(sub))
            for name in names:
                if name in present:
                    return name, _read_file(sub, name, f"{folder}/{name}", TEXT_MAX_BYTES)
            return None
        finally:
            os.close(sub)

    def files(self, folder: str) -> FolderFiles:
        """The regular files of ``environment``, ``tests`` or ``solution``."""
        sub = self._open(folder)
        try:
            return read_folder(sub, folder)
        finally:
            os.close(sub)


# -- naming task folders for `rollstream submit` --------------------------------------------
def is_task_folder(path: Path) -> bool:
    return (path / "task.toml").is_file() and (path / "instruction.md").is_file()


def task_folders(spec: Path) -> list[Path] | None:
    """The task folders ``spec`` names, absolute: a task folder, a folder of them, or a dataset
    file (a text file of folder paths, one a line, '#' comments; or a Harbor registry JSON whose
    tasks carry local ``path``s), relative paths taken from the file's folder. None when ``spec``
    is none of these (a JSONL file of jobs, say)."""
    spec = spec.absolute()
    if spec.is_dir():
        if is_task_folder(spec):
            return [spec]
        found = sorted(child for child in spec.iterdir() if child.is_dir() and is_task_folder(child))
        return found or None
    if not spec.is_file() or spec.suffix not in (".txt", ".json"):
        return None
    text = spec.read_text(encoding="utf-8")
    if spec.suffix == ".txt":
        names = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if any(name.startswith("{") for name in names):
            return None  # a file of JSON jobs
    else:
        listed = _registry_paths(text)
        if listed is None:
            return None
        names = listed
    folders = [(spec.parent / name).absolute() for name in names]
    missing = [str(folder) for folder in folders if not is_task_folder(folder)]
    if missing:
        raise HarborTaskRefused(f"{spec} names folders that are not Harbor task folders (task.toml and "
                                f"instruction.md): {', '.join(missing[:5])}")
    return folders


def _registry_paths(text: str) -> list[str] | None:
    """The tasks' paths of a Harbor registry JSON (a dataset, or a list of them, with 'tasks'),
    or None when ``text`` is not one."""
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return None
    datasets = data if isinstance(data, list) else [data]
    if not datasets or not all(isinstance(d, dict) and isinstance(d.get("tasks"), list) for d in datasets):
        return None
    paths = []
    spec = "the dataset file"
    for dataset in datasets:
        for task in dataset["tasks"]:
            if not isinstance(task, dict) or not isinstance(task.get("path"), str):
                raise HarborTaskRefused(f"{spec}: each task needs a 'path' string")
            if task.get("git_url"):
                raise HarborTaskRefused(f"{spec}: task {task['path']!r} names a git_url; fetch it first and name "
                                        "the local folder (no network here)")
            paths.append(task["path"])
    return paths
