"""A Harbor task's multi-service environment (``environment/docker-compose.yaml``), as Harbor's
docker environment runs it: the service ``main`` is the agent's container, built from
environment/Dockerfile as a single-service task's is; every other service is a sidecar (a
database, a web server) the agent and the tests reach by its service name.

Here each sidecar's image is built once per node beside the main image (its ``build`` context, a
folder beneath environment/, or an ``image`` mapped as FROM lines are), and the docker backend
starts the sidecars on a network of the sandbox's own (backends/docker.py), under the same
capability and limit policy as the main container, and removes them with it; eval's fresh
sandbox gets fresh sidecars. bwrap and Singularity have no network of their own to put them on,
so such a task runs on the docker backend.

Every container, main included, reaches every other by its service name. ``depends_on`` orders
the starts (its conditions ``service_started``, ``service_healthy``, ``service_completed_successfully``
honoured: main, and so the agent, starts once what it depends on is ready) and a sidecar's
``healthcheck`` is what ``service_healthy`` waits for (backends/docker_services.py).

The compose file comes from a job's folder: only the keys that describe what runs are taken
(``build``, ``image``, ``command``, ``environment``, ``depends_on``, ``healthcheck``; ``expose``,
``restart``, ``container_name`` and ``hostname`` are ignored, as is main's healthcheck: main runs
the sandbox's own command); a key that would reach the host (``volumes``, ``ports``,
``privileged``, ``cap_add``, ``network_mode``, ...) refuses the task.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import tempfile
from dataclasses import dataclass, field

from pydantic import ValidationError

from rollstream.sandbox_spec import DependencyCondition, HealthCheck, SidecarSpec
from rollstream.sandboxes.backends.docker_services import MAIN, start_order
from rollstream.sandboxes.env_images import EnvBuildFailed, image_exists
from rollstream.tasks.harbor_folder import COMPOSE_FILES, FolderFiles, HarborTaskRefused, TaskFolder
from rollstream.tasks.harbor_image import map_dockerfile, map_image, run_build

SIDECAR_REPOSITORY = "localhost/rollstream/harbor-svc"
TAKEN = ("build", "image", "command", "environment", "depends_on", "healthcheck")
IGNORED = ("expose", "restart", "container_name", "hostname", "init", "labels")
CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
HEALTHCHECK_KEYS = {"test": "test", "interval": "interval_s", "timeout": "timeout_s", "retries": "retries",
                    "start_period": "start_period_s", "start_interval": "start_interval_s", "disable": "disable"}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(h|ms|m|s|us|µs|ns)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_SERVICE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Service:
    name: str
    context: str | None = None  # a folder beneath environment/ ("." is environment/ itself)
    dockerfile: str = "Dockerfile"
    image: str | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    healthcheck: HealthCheck | None = None
    depends_on: dict[str, DependencyCondition] = field(default_factory=dict)


@dataclass
class Compose:
    """What a task's compose file asks for: main's extra environment and what it waits for, and the sidecars."""

    main_env: dict[str, str]
    sidecars: list[Service]
    main_depends_on: dict[str, DependencyCondition] = field(default_factory=dict)


def _env(value: object, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        pairs = [str(item).partition("=") for item in value]
        value = {name: rest for name, _, rest in pairs}
    if not isinstance(value, dict):
        raise HarborTaskRefused(f"harbor: {where}.environment must be a mapping or a list of NAME=value")
    env = {}
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise HarborTaskRefused(f"harbor: {where}.environment names {name!r}, not a variable name")
        env[name] = "" if item is None else str(item)
    return env


def _command(value: object, where: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return ["/bin/sh", "-c", value]
    if isinstance(value, list) and all(isinstance(item, (str, int, float)) for item in value):
        return [str(item) for item in value]
    raise HarborTaskRefused(f"harbor: {where}.command must be a string or a list of strings")


def _depends_on(value: object, where: str) -> dict[str, DependencyCondition]:
    """compose's short form (a list of names: started) or long form (name -> {condition: ...})."""
    if value is None:
        return {}
    if isinstance(value, list) and all(isinstance(name, str) for name in value):
        return {name: "service_started" for name in value}
    if not isinstance(value, dict):
        raise HarborTaskRefused(f"harbor: {where}.depends_on must be a list of service names or a mapping")
    found: dict[str, DependencyCondition] = {}
    for name, entry in value.items():
        condition = (entry or {}).get("condition", "service_started") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or condition not in CONDITIONS:
            raise HarborTaskRefused(f"harbor: {where}.depends_on.{name} waits for {condition!r}; a condition is one "
                                    f"of {list(CONDITIONS)}")
        found[name] = condition
    return found


def _duration(value: object, where: str) -> float:
    """Seconds of a compose duration (``1m30s``, ``500ms``, ``10s``)."""
    text = value if isinstance(value, str) else ""
    if not text or _DURATION.sub("", text):
        raise HarborTaskRefused(f"harbor: {where} is {value!r}, not a duration such as 10s, 1m30s or 500ms")
    return sum(float(number) * _UNIT_S[unit] for number, unit in _DURATION.findall(text))


def _healthcheck(value: object, where: str) -> HealthCheck | None:
    """A sidecar's healthcheck as rollstream probes it; None where it is disabled or NONE."""
    if not isinstance(value, dict) or set(value) - set(HEALTHCHECK_KEYS):
        raise HarborTaskRefused(f"harbor: {where}.healthcheck takes {list(HEALTHCHECK_KEYS)}")
    test = value.get("test")
    if value.get("disable") is True or test in (["NONE"], "NONE"):
        return None
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if not (isinstance(test, list) and len(test) >= 2 and test[0] in ("CMD", "CMD-SHELL")
            and all(isinstance(word, str) for word in test)):
        raise HarborTaskRefused(f"harbor: {where}.healthcheck.test must be a command string, [\"CMD\", ...] or "
                                "[\"CMD-SHELL\", \"...\"] (an image's own HEALTHCHECK is not read)")
    fields: dict[str, object] = {"test": test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", " ".join(test[1:])]}
    for key, name in HEALTHCHECK_KEYS.items():
        if key in ("test", "disable") or key not in value:
            continue
        fields[name] = value[key] if key == "retries" else _duration(value[key], f"{where}.healthcheck.{key}")
    try:
        return HealthCheck.model_validate(fields)
    except ValidationError as error:
        raise HarborTaskRefused(f"harbor: {where}.healthcheck: {error}") from None


def _context(value: object, where: str) -> tuple[str, str]:
    """(context folder beneath environment/, Dockerfile name) of a ``build`` entry."""
    if isinstance(value, str):
        value = {"context": value}
    if not isinstance(value, dict) or set(value) - {"context", "dockerfile"}:
        raise HarborTaskRefused(f"harbor: {where}.build takes a context folder (and a dockerfile) only")
    context = posixpath.normpath(str(value.get("context", ".")))
    dockerfile = posixpath.normpath(str(value.get("dockerfile", "Dockerfile")))
    for path in (context, dockerfile):
        if path.startswith(("/", "..")) or "\x00" in path:
            raise HarborTaskRefused(f"harbor: {where}.build names {path!r}; a context lies beneath environment/")
    return context, dockerfile


def parse(text: str, where: str) -> Compose:
    """The compose file's services; HarborTaskRefused for what rollstream does not run."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise HarborTaskRefused(f"harbor: {where} is not valid YAML: {error}") from None
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        raise HarborTaskRefused(f"harbor: {where} has no services")
    extra = sorted(set(data) - {"services", "version", "name"})
    if extra:
        raise HarborTaskRefused(f"harbor: {where} has top-level {extra}; only services are run (no volumes, "
                                "networks, secrets or configs of the host)")
    main_env: dict[str, str] = {}
    main_depends_on: dict[str, DependencyCondition] = {}
    sidecars = []
    for name, body in services.items():
        where_s = f"{where}: services.{name}"
        if not isinstance(name, str) or not _SERVICE.fullmatch(name):
            raise HarborTaskRefused(f"harbor: {where} names a service {name!r}; names are [a-z0-9_-], up to 63")
        body = body or {}
        if not isinstance(body, dict):
            raise HarborTaskRefused(f"harbor: {where_s} is not a mapping")
        refused = sorted(set(body) - set(TAKEN) - set(IGNORED))
        if refused:
            raise HarborTaskRefused(f"harbor: {where_s} sets {refused}, which rollstream does not give a task's "
                                    f"container; a service takes {list(TAKEN)}")
        if name == MAIN:
            main_env = _env(body.get("environment"), where_s)
            main_depends_on = _depends_on(body.get("depends_on"), where_s)
            continue
        service = Service(name, image=body.get("image"), command=_command(body.get("command"), where_s),
                          env=_env(body.get("environment"), where_s),
                          depends_on=_depends_on(body.get("depends_on"), where_s),
                          healthcheck=_healthcheck(body["healthcheck"], where_s) if "healthcheck" in body else None)
        if "build" in body:
            service.context, service.dockerfile = _context(body["build"], where_s)
        elif not isinstance(service.image, str) or not service.image or service.image.startswith("-"):
            raise HarborTaskRefused(f"harbor: {where_s} has neither a build context nor an image")
        sidecars.append(service)
    try:  # the order the containers will start in: refused now if there is none
        start_order(sidecars, main_depends_on)
    except ValueError as error:
        raise HarborTaskRefused(f"harbor: {where}: {error}") from None
    return Compose(main_env, sidecars, main_depends_on)


def load(folder: TaskFolder) -> Compose | None:
    """The task's compose services, or None for a single-Dockerfile environment."""
    found = folder.file("environment", COMPOSE_FILES)
    if found is None:
        return None
    return parse(found[1].decode("utf-8", "replace"), f"{folder.path}/environment/{found[0]}")


def sidecar_tag(key: str, service: Service) -> str:
    return f"{SIDECAR_REPOSITORY}:{key}-{service.name}"


def sidecar_specs(compose: Compose, key: str, mapping: dict[str, str]) -> list[SidecarSpec]:
    """What the docker backend starts beside the main container (``key`` is the main image's,
    which covers the whole environment folder, so a sidecar's tag changes with its context)."""
    return [SidecarSpec(name=s.name, command=s.command, env=s.env, healthcheck=s.healthcheck, depends_on=s.depends_on,
                        image=sidecar_tag(key, s) if s.context is not None else map_image(s.image or "", mapping))
            for s in compose.sidecars]


def ensure_sidecars(folder: TaskFolder, compose: Compose, key: str, mapping: dict[str, str], network: str) -> None:
    """Each sidecar's image, built unless the engine has it; EnvBuildFailed naming the service
    that does not build, or whose image is not here."""
    files = folder.files("environment")
    for service, spec in zip(compose.sidecars, sidecar_specs(compose, key, mapping)):
        if image_exists(spec.image):
            continue
        if service.context is None:
            raise EnvBuildFailed(f"service {service.name}: image {service.image} ({spec.image} here) is not in the "
                                 "container engine and no registry answers; give it a build context")
        _build_sidecar(folder, files, service, spec.image, mapping, network)


def _build_sidecar(folder: TaskFolder, files: FolderFiles, service: Service, tag: str, mapping: dict[str, str],
                   network: str) -> None:
    assert service.context is not None
    prefix = "" if service.context == "." else service.context.rstrip("/") + "/"
    context_files = {path[len(prefix):]: entry for path, entry in files.files.items() if path.startswith(prefix)}
    if service.dockerfile not in context_files:
        raise EnvBuildFailed(f"service {service.name}: environment/{prefix}{service.dockerfile} does not exist")
    dockerfile, _ = map_dockerfile(context_files[service.dockerfile][0].decode("utf-8", "replace"), mapping)
    name = "Containerfile.rs-" + hashlib.sha256(dockerfile.encode()).hexdigest()[:8]
    with tempfile.TemporaryDirectory(prefix="rs-harbor-svc-", dir=os.environ.get("TMPDIR", "/var/tmp")) as context:
        FolderFiles(context_files).write_to(context)
        with open(os.path.join(context, name), "w", encoding="utf-8") as handle:
            handle.write(dockerfile)
        try:
            run_build(context, os.path.join(context, name), tag, network, folder.config.environment.build_timeout_sec)
        except EnvBuildFailed as failed:
            raise EnvBuildFailed(f"service {service.name}: {failed}") from None
