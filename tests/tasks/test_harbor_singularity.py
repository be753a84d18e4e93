"""A Harbor task on Singularity/Apptainer, which this machine does not have: init makes the task's
environment image a SIF (images.sif_from_engine_image: the engine's image saved as an OCI archive,
then `apptainer build`), and the backend starts an instance of that SIF with the task's workdir,
environment and network off. Checked as the commands built, not run; where no apptainer is on PATH
the job fails saying so."""

from __future__ import annotations

import os

import pytest

from rollstream.errors import InvalidJob, JobFailed
from rollstream.messages import Envelope, Job
from rollstream.sandboxes.backends.base import SandboxLayout
from rollstream.sandboxes.backends.singularity import SingularityBackend, singularity_binary
from rollstream.sandboxes.image_cache import sif_path
from rollstream.sandboxes.images import sif_build_argv
from rollstream.tasks.base import TaskContext
from rollstream.tasks.harbor import HarborTask

from . import harbor_fixtures
from .conftest import needs_bwrap
from .harbor_fixtures import TASKS_DIR, copy_task

pytestmark = needs_bwrap
APPTAINER = "/usr/bin/apptainer"


@pytest.fixture(scope="session")
def harbor_environment(tmp_path_factory):
    yield from harbor_fixtures.harbor_environment(tmp_path_factory)


def test_the_singularity_instance_of_a_harbor_task_runs_its_sif_in_its_workdir_offline(
        harbor_environment, tmp_path, monkeypatch):
    spec = HarborTask().sandbox_spec({"path": str(harbor_environment / "fix-calc")})
    monkeypatch.setenv("ROLLSTREAM_IMAGES_DIR", str(tmp_path))
    sif = sif_path(spec.image)  # where init's sif_from_engine_image leaves it
    open(sif, "w").close()
    layout = SandboxLayout(str(tmp_path / "sb" / "job-1"))
    plan = SingularityBackend(binary=APPTAINER).plan(spec, layout, "job-1", "owner")
    start = plan.start_argv
    assert start[:3] == [APPTAINER, "instance", "start"] and start[-2:] == [sif, "rs-job-1"]
    assert start[start.index("--network") + 1] == "none" and "--net" in start and "--containall" in start
    assert f"{layout.work}:/app" in start and start[start.index("--pwd") + 1] == "/app"
    assert f"{layout.tmp}:/tmp" in start  # Harbor's /logs, /tests, /solution point into the private /tmp
    exec_prefix = plan.bash_argv[:plan.bash_argv.index("instance://rs-job-1") + 1]
    assert exec_prefix[:5] == [APPTAINER, "exec", "--cleanenv", "--pwd", "/app"]
    assert "HOME=/root" in exec_prefix  # the image runs as root: Harbor's scripts expect root's home
    assert plan.stop_argv == [APPTAINER, "instance", "stop", "rs-job-1"]
    # Harbor's paths made and the workdir restored first, as on every backend.
    assert "tar -x --no-same-owner -f /opt/rs-harbor/workdir.tar -C /app" in spec.setup_commands[0]
    # The SIF is made from the engine's image through an OCI archive.
    assert sif_build_argv(spec.image, sif, "/tmp/x.oci.tar")[1:] == ["build", "--force", sif,
                                                                    "oci-archive:///tmp/x.oci.tar"]


async def test_on_a_singularity_node_init_makes_the_sif_or_says_what_is_missing(harbor_environment, tmp_path,
                                                                                 monkeypatch):
    # A node without apptainer: PATH keeps every folder but one holding apptainer or singularity.
    folders = os.environ.get("PATH", "").split(os.pathsep)
    monkeypatch.setenv("PATH", os.pathsep.join(
        f for f in folders if not any(os.path.exists(os.path.join(f, n)) for n in ("apptainer", "singularity"))))
    assert singularity_binary() is None
    env = Envelope(job=Job(task="harbor", instance={"path": str(harbor_environment / "hello-file")},
                           sandbox={"backend": "singularity"}))
    with pytest.raises(JobFailed, match="making a SIF needs apptainer or singularity on PATH"):
        await HarborTask().prepare_environment(env, TaskContext(node="n", work_dir=tmp_path))


async def test_a_task_needing_services_or_the_network_is_refused_on_singularity(harbor_environment, tmp_path):
    folder = copy_task(TASKS_DIR / "hello-file", tmp_path / "with-db")
    (folder / "environment" / "docker-compose.yaml").write_text("services:\n  db:\n    image: python:3.12-slim\n")
    env = Envelope(job=Job(task="harbor", instance={"path": str(folder)}, sandbox={"backend": "singularity"}))
    with pytest.raises(InvalidJob, match="only backend 'docker'.*Singularity can only share the host's"):
        await HarborTask().prepare_environment(env, TaskContext(node="n", work_dir=tmp_path))
