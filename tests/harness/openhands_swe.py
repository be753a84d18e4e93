"""The OpenHands SDK preset's SWE episode (its lean variant: openhands_scripted.py) captured where a
job runs it, and the tiny model that has learnt it by heart (built by tests/model_cache.py, never in
a test): an edit of the shipped SWE instance's checkout by one terminal command, then finish.

OpenHands' terminal observation names its working folder and its interpreter, so the episode is
captured in a sandbox of the task, set up as the task's init sets it up (node_clis.py does so for
the Node.js CLIs): in bwrap, and in podman from the preset's layer on the instance's environment
image where an engine answers. Every prompt the model learns is then the one a job gives it, to the
byte, on either backend. (openhands_scripted.py keeps the arith episode; its text keys that model,
so the SWE episode moved here rather than change it.)"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from rollstream.agent.presets import driver_source, find_preset, install_on_host, load_preset
from rollstream.sandboxes.backends.common import host_python_path

from .openhands_scripted import LEAN, PRESET, REPLIES, _examples, lean_preset_text, write_lean_preset

EPISODE = "swe"


def _instruction() -> str:
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.tasks.swe import SweTask

    from .sandbox_presets import swe_instance

    return instruction_of(SweTask().prompt_messages(swe_instance()))


def trained_folder(parent: Path, which: str = EPISODE) -> Path:
    """Where the model is kept: named by the preset, the episode, the runner, the capture and this
    file; by the PATH of a bwrap sandbox on the host's root, whose first folder is this
    interpreter's (the terminal names it in its observation: CI's clone in its own folder shares
    this cache); and by whether a podman engine answers, whose capture it then learns too."""
    from rollstream.sandboxes.backends.docker import DockerBackend

    assert which == EPISODE, which
    parts = [lean_preset_text(), json.dumps([_instruction(), REPLIES[EPISODE]]), driver_source("openhands").read_text(),
             Path(__file__).read_text(), Path(__file__).with_name("door_capture.py").read_text(), host_python_path(),
             f"container engine: {DockerBackend().available()}"]
    return parent / f"openhands-swe-{hashlib.sha1(chr(10).join(parts).encode()).hexdigest()[:12]}"


def build(parent: Path, which: str = EPISODE, steps: int = 300) -> Path:
    """Install the preset (once), capture the episode in each sandbox, and train the tiny model on
    the door's renderings of each call (prompt, then reply)."""
    from .episode_model import train_episode

    return train_episode(trained_folder(parent, which), parent / "base", episode_examples, steps)


def _checkout(instance: dict):
    """The task's init of ``instance`` (the checkout), as ``capture_in_sandbox``'s ``prepare``."""
    from rollstream.messages import Envelope, Job
    from rollstream.tasks.swe import SweTask

    async def prepare(handle, sandbox) -> None:
        await SweTask().prepare(Envelope(job=Job(task="swe", instance=instance), sandbox=handle), sandbox)

    return prepare


def _sandboxes() -> list[tuple[str, dict, object]]:
    """(backend, instance, spec) of each capture: bwrap on the host's root, as a bwrap job runs; and
    where an engine answers, podman from the preset's layer on the instance's environment image, as
    init picks it for a preset job (tests/harness/test_swe_on_podman.py)."""
    from rollstream.agent.harness_images import layer_tag
    from rollstream.sandboxes.backends.docker import DockerBackend
    from rollstream.tasks.swe import SweTask

    from . import swe_podman_image
    from .sandbox_presets import swe_instance

    where = [("bwrap", swe_instance(), SweTask().sandbox_spec(swe_instance()))]
    if DockerBackend().available():
        instance = swe_podman_image.instance()
        spec = SweTask().sandbox_spec(instance)
        with tempfile.TemporaryDirectory(prefix="rs-swe-podman-") as scratch:  # once (scripts/install-harnesses)
            built = swe_podman_image.build(Path(scratch), (PRESET,))
        assert built["harnesses"][PRESET] == layer_tag(find_preset(PRESET), spec.image), built
        where.append(("docker", instance, spec.model_copy(update={"image": built["harnesses"][PRESET]})))
    return where


def episode_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """The episode's calls as the door rendered them in each sandbox (prompt, then the scripted
    reply: mask 1), the preset installed on this host first (once)."""
    from .door_capture import capture_in_sandbox

    install_on_host(find_preset(PRESET))
    examples = []
    for backend, instance, spec in _sandboxes():
        with tempfile.TemporaryDirectory(prefix="rs-capture-") as scratch:
            lean = load_preset(write_lean_preset(Path(scratch)) / f"{LEAN}.toml")
            captured = capture_in_sandbox(tokenizer, REPLIES[EPISODE], lean, _instruction(), spec,
                                          prepare=_checkout(instance), backend=backend)
        examples += _examples(captured, EPISODE)
    return examples
