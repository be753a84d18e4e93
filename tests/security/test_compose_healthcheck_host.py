"""A Harbor task's compose file, from the attacker's side: its healthchecks are commands rollstream
runs (podman runs none without systemd), from a shell script on the host. A test, a service's
command or environment written to run on the host instead (shell substitutions in every form the
compose file can carry them) runs nowhere but in the service's own container: the host's shell
gets each word quoted, and the probe is `docker exec` into the sidecar."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import yaml

from rollstream.config import load_settings
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.errors import SandboxServiceFailed
from rollstream.sandboxes.lifecycle import create_sandbox
from rollstream.tasks import harbor_compose

pytestmark = pytest.mark.skipif(not DockerBackend().available(),
                                reason="no container engine (podman's socket: scripts/install-podman)")
IMAGE = "localhost/rollstream/python:bookworm"


async def test_a_compose_healthcheck_runs_in_its_service_never_on_the_host(sandbox_root):
    marker = Path(f"/tmp/rs-compose-host-{uuid.uuid4().hex[:12]}")
    on_host = [f"$(touch {marker}-a)", f"`touch {marker}-b`", f"'; touch {marker}-c; '", f"\"; touch {marker}-d\""]
    text = yaml.safe_dump({"services": {
        "main": {"depends_on": {"kv": {"condition": "service_healthy"}}},
        "kv": {"image": "python:3.12-slim", "command": ["sh", "-c", "sleep 600", "sh", *on_host],
               "environment": {"X": on_host[0]},
               "healthcheck": {"test": ["CMD", "sh", "-c", 'echo "probed in $(hostname)"; exit 1', *on_host],
                               "interval": "100ms", "retries": 2}}}})
    compose = harbor_compose.parse(text, "docker-compose.yaml")
    spec = SandboxSpec(backend="docker", image=IMAGE, depends_on=compose.main_depends_on, setup_timeout_s=60,
                       services=harbor_compose.sidecar_specs(compose, "k", load_settings().harbor_base_images))
    with pytest.raises(SandboxServiceFailed, match="service kv is unhealthy: .* its last output: probed in kv"):
        await create_sandbox(spec, sandbox_id="h-inject-0", root_dir=sandbox_root)  # the probe ran in the sidecar
    assert sorted(marker.parent.glob(marker.name + "*")) == []
