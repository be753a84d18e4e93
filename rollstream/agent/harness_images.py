"""Harness layers: a preset installed onto an environment image (an SWE instance's, built by
sandboxes/env_images.py), once, when the environment is built (`rollstream images build ...
--harness NAME`), never per rollout. Init starts the agent's podman/Docker sandbox of a job that
names the preset from that layer; eval's fresh sandbox starts from the environment image itself,
so the harness never reaches the tests that score it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from rollstream.agent.presets import IMAGE_REPOSITORY, Preset, build_image, find_preset
from rollstream.errors import JobFailed
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.env_images import image_exists

log = logging.getLogger(__name__)

# The backends that start a sandbox from an engine image (a bwrap job on the host's root finds the
# host's install of the preset).
ENGINE_BACKENDS = ("docker",)
_layers_seen: set[str] = set()  # layer tags this process found in the engine (an image is not unbuilt under it)


def layer_tag(preset: Preset, env_image: str) -> str:
    """The harness layer of ``preset`` on ``env_image``: keyed by the image and the preset's install
    (its pins, its prefix), so the presets of one install (variants with other options) share it."""
    return preset.image_tag(env_image)


def harness_presets(names: list[str], extra_dirs: list[Path] | None = None) -> list[Preset]:
    """The presets ``names`` that install something (a layer holds an install); an unknown name fails."""
    found = []
    for name in names:
        preset = find_preset(name, extra_dirs)
        if preset is None:
            raise ValueError(f"no harness preset {name!r}; rollstream harnesses list shows them")
        if preset.installs is None:
            raise ValueError(f"harness preset {name!r} installs nothing: its command must be in the image already")
        found.append(preset)
    return found


def build_layers(env_image: str, presets: list[Preset], force: bool = False) -> dict[str, str]:
    """Build (once; cached by tag, again with ``force``) each preset's layer on ``env_image``:
    {preset name: layer tag}."""
    built = {}
    for preset in presets:
        built[preset.name] = build_image(preset, env_image, force=force)
        log.info("harness layer %s on %s: %s", preset.name, env_image, built[preset.name])
    return built


def add_layers(built: list[dict], presets: list[Preset]) -> list[dict]:
    """The environments ``built`` (swe_env.build_for_instances's summaries), each with the layers of
    ``presets`` on its image under "harnesses" ({preset name: layer tag})."""
    for entry in built:  # an environment image (re)built now gets its layers anew: the tag names the old one
        entry["harnesses"] = build_layers(entry["tag"], presets, force=entry["built"])
    return built


async def agent_spec(spec: SandboxSpec, resolved: SandboxSpec, harness: str | None,
                     extra_dirs: list[Path] | None = None) -> SandboxSpec:
    """The spec of the agent's sandbox (``spec``: the task's; ``resolved``: it with the node's
    backend and the job's overrides; ``harness``: the job's agent.harness): on an engine backend,
    a job whose harness preset installs something starts from that preset's layer on the task's
    environment image. Unchanged where the job chose its image itself, names no preset, or the
    task names no image."""
    if (harness is None or resolved.backend not in ENGINE_BACKENDS or spec.image is None
            or resolved.image != spec.image or spec.image.startswith(IMAGE_REPOSITORY + ":")):
        return spec
    tag = await asyncio.to_thread(_layer_of, harness, spec.image, extra_dirs)
    return spec if tag is None else spec.model_copy(update={"image": tag})


def _layer_of(name: str, env_image: str, extra_dirs: list[Path] | None) -> str | None:
    """The built layer of preset ``name`` on ``env_image``; None where ``name`` is no preset that installs."""
    preset = find_preset(name, extra_dirs)
    if preset is None or preset.installs is None:
        return None  # a Python harness, or a preset whose command the image holds
    tag = layer_tag(preset, env_image)
    if tag not in _layers_seen:
        if not image_exists(tag):
            raise JobFailed(f"the environment image {env_image} has no layer of harness preset {name!r} ({tag}); "
                            f"build it once with the environment: rollstream images build INSTANCES.jsonl --now "
                            f"--harness {name} (or rollstream harnesses install {name} --image {env_image})",
                            retryable=False)
        _layers_seen.add(tag)
    return tag
