"""Harness layers: a preset installed onto an environment image (an SWE instance's, built by
sandboxes/env_images.py), once, when the environment is built (`rollstream images build ...
--harness NAME`, here or by a node's image worker), never per rollout. The layer is an engine
image; for bwrap its rootfs is unpacked and for Singularity a SIF made from it, as from any
environment image. Init starts the agent's sandbox of a job that names the preset from that
layer on its backend; eval's fresh sandbox starts from the environment image itself, so the
harness never reaches the tests that score it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from rollstream.agent.presets import IMAGE_REPOSITORY, Preset, build_image, find_preset
from rollstream.errors import JobFailed
from rollstream.sandbox_spec import SandboxSpec
from rollstream.sandboxes.env_images import image_exists
from rollstream.sandboxes.image_cache import rootfs_path, sif_path
from rollstream.sandboxes.images import deduplicate, export_rootfs, sif_from_engine_image

log = logging.getLogger(__name__)

# The backends that start a sandbox from an engine image.
ENGINE_BACKENDS = ("docker",)
# Every backend that runs an environment image: the engine's image, bwrap its unpacked rootfs,
# Singularity a SIF of it. (A bwrap job on the host's root, no image, finds the host's install.)
LAYERED_BACKENDS = ("docker", "bwrap", "singularity")
_layers_seen: set[str] = set()  # "backend tag" of layers this process found built (one is not unbuilt under it)


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


def build_layers(env_image: str, presets: list[Preset], force: bool = False,
                 backends: tuple[str, ...] = ("docker",), images_dir: str | None = None) -> dict[str, dict[str, str]]:
    """Build (once; cached by tag, again with ``force``) each preset's layer on ``env_image``, and for
    ``backends`` bwrap/singularity its rootfs/SIF: {preset name: {"tag": ..., "rootfs": ..., "sif": ...}}."""
    built: dict[str, dict[str, str]] = {}
    for preset in presets:
        tag = build_image(preset, env_image, force=force)
        built[preset.name] = {"tag": tag}
        if "bwrap" in backends:
            built[preset.name]["rootfs"] = export_rootfs(tag, images_dir, force=force)
        if "singularity" in backends:
            built[preset.name]["sif"] = sif_from_engine_image(tag, images_dir, force=force)
        log.info("harness layer %s on %s: %s", preset.name, env_image, built[preset.name])
    return built


def add_layers(built: list[dict], presets: list[Preset], backends: tuple[str, ...] = ("docker",),
               images_dir: str | None = None) -> list[dict]:
    """The environments ``built`` (swe_env.build_for_instances's summaries), each with the layers of
    ``presets`` on its image: "harnesses" {preset name: layer tag}, and where ``backends`` ask,
    "harness_rootfs" / "harness_sifs" {preset name: path}."""
    for entry in built:  # an environment image (re)built now gets its layers anew: the tag names the old one
        layers = build_layers(entry["tag"], presets, entry["built"], backends, images_dir)
        entry["harnesses"] = {name: layer["tag"] for name, layer in layers.items()}
        for key, artifact in (("harness_rootfs", "rootfs"), ("harness_sifs", "sif")):
            if artifact in next(iter(layers.values()), {}):
                entry[key] = {name: layer[artifact] for name, layer in layers.items()}
    if "bwrap" in backends and presets and built:
        deduplicate(images_dir)  # a layer's rootfs is its environment's plus the install: link the shared files
    return built


async def agent_spec(spec: SandboxSpec, resolved: SandboxSpec, harness: str | None,
                     extra_dirs: list[Path] | None = None) -> SandboxSpec:
    """The spec of the agent's sandbox (``spec``: the task's; ``resolved``: it with the node's
    backend and the job's overrides; ``harness``: the job's agent.harness): a job whose harness
    preset installs something starts from that preset's layer on the task's environment image,
    on its backend (the engine's image, its rootfs, its SIF). Unchanged where the job chose its
    image itself, names no preset, or the task names no image."""
    if (harness is None or resolved.backend not in LAYERED_BACKENDS or spec.image is None
            or resolved.image != spec.image or spec.image.startswith(IMAGE_REPOSITORY + ":")):
        return spec
    tag = await asyncio.to_thread(_layer_of, harness, spec.image, resolved.backend, extra_dirs)
    return spec if tag is None else spec.model_copy(update={"image": tag})


def _layer_of(name: str, env_image: str, backend: str, extra_dirs: list[Path] | None) -> str | None:
    """The built layer of preset ``name`` on ``env_image`` (for bwrap: unpacked; for Singularity: a
    SIF made); None where ``name`` is no preset that installs."""
    preset = find_preset(name, extra_dirs)
    if preset is None or preset.installs is None:
        return None  # a Python harness, or a preset whose command the image holds
    tag = layer_tag(preset, env_image)
    seen = f"{backend} {tag}"
    if seen not in _layers_seen:
        if backend == "bwrap":
            there, flag = os.path.isdir(rootfs_path(tag)), " --backend bwrap"
        elif backend == "singularity":
            there, flag = os.path.exists(sif_path(tag)), " --backend singularity"
        else:
            there, flag = image_exists(tag), ""
        if not there:
            raise JobFailed(f"the environment image {env_image} has no {backend} layer of harness preset {name!r} "
                            f"({tag}); build it once with the environment: rollstream images build INSTANCES.jsonl"
                            f"{flag} --harness {name}", retryable=False)
        _layers_seen.add(seen)
    return tag
