"""Which sandbox fields a job may override: the operator's policy, applied where the init stage
merges a job's `sandbox` overrides into its task's SandboxSpec.

A job is trusted to spend compute, not to choose how unconfined its code runs. By default it
may lower limits and shape what runs inside the sandbox (files, env, setup commands), never
pick the backend, the image, the network, the masks or the unisolated `local` backend; the
operator widens that with the settings `sandbox_job_overrides` and
`sandbox_job_may_raise_limits` (rollstream/config.py).

Every image a job's sandbox starts from passes here too, whether the job overrode it or its task
took it from the instance (a SWE record's ``image``): a reference from the operator's list
(`sandbox_images`), or a host folder or file beneath the operator's image folders
(`sandbox_image_folders`, default the image cache), never `/` or another host folder.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from rollstream.errors import InvalidJob
from rollstream.sandbox_spec import SandboxLimits, SandboxSpec
from rollstream.sandboxes.image_cache import default_images_dir

# What a job may override unless the operator says otherwise: all of it runs inside the
# sandbox, confined as the operator configured it.
DEFAULT_JOB_OVERRIDES = ("limits", "files", "env", "setup_commands", "setup_timeout_s", "workdir")
# Never from a job, whatever the setting says.
NEVER_FROM_A_JOB = ("allow_unisolated", "capabilities", "services", "depends_on")  # the last two: the task's compose
# Setup commands run through the backend: unconfined on the host with `local`.
_UNCONFINED_BACKENDS = ("local",)
# Fields whose value is a budget: a job may only lower it unless raising is allowed.
_BUDGET_FIELDS = ("setup_timeout_s",)
SETTING = "sandbox_job_overrides (ROLLSTREAM_SANDBOX_JOB_OVERRIDES)"
RAISE_SETTING = "sandbox_job_may_raise_limits (ROLLSTREAM_SANDBOX_JOB_MAY_RAISE_LIMITS)"
# Images a job's sandbox may start from unless the operator says otherwise: those rollstream built.
DEFAULT_IMAGES = ("localhost/rollstream/",)
IMAGES_SETTING = "sandbox_images (ROLLSTREAM_SANDBOX_IMAGES)"
FOLDERS_SETTING = "sandbox_image_folders (ROLLSTREAM_SANDBOX_IMAGE_FOLDERS)"
# A reference as engines write them (registry/name:tag@digest, docker://...): printable, no space,
# not an option (-...) and not a relative path (./..).
_REFERENCE = re.compile(r"[A-Za-z0-9][\x21-\x7e]*")


class SandboxOverrideRefused(InvalidJob):
    """A job asked to change a sandbox field that the operator's policy does not let it change."""


@dataclass(frozen=True)
class OverridePolicy:
    """The sandbox fields a job may override; limits only downwards unless `may_raise_limits`."""

    allowed: tuple[str, ...] = DEFAULT_JOB_OVERRIDES
    may_raise_limits: bool = False
    images: tuple[str, ...] = DEFAULT_IMAGES
    image_folders: tuple[str, ...] = ()  # empty: the image cache alone

    @classmethod
    def from_settings(cls, settings: Any) -> OverridePolicy:
        return cls(tuple(settings.sandbox_job_overrides), bool(settings.sandbox_job_may_raise_limits),
                   tuple(settings.sandbox_images), tuple(str(f) for f in settings.sandbox_image_folders))

    def check_fields(self, overrides: object) -> None:
        """Refuse fields the policy never lets a job set (usable at submit, without the task's spec)."""
        if not isinstance(overrides, dict):
            raise SandboxOverrideRefused(f"job.sandbox must be a mapping of SandboxSpec fields, not "
                                         f"{type(overrides).__name__}")
        for name in overrides:
            if name not in SandboxSpec.model_fields:
                raise SandboxOverrideRefused(
                    f"job.sandbox.{name} is not a sandbox field; known: {', '.join(SandboxSpec.model_fields)}")
            if name in NEVER_FROM_A_JOB:
                raise SandboxOverrideRefused(
                    f"job.sandbox.{name} cannot come from a job: only the operator's configuration (and for "
                    "capabilities, the task) decides how unconfined its code runs")
            if name not in self.allowed:
                raise SandboxOverrideRefused(
                    f"job.sandbox.{name} may not be overridden by a job under this node's policy; the "
                    f"operator allows {', '.join(self.allowed) or 'nothing'} (setting {SETTING})")
        if overrides.get("backend") in _UNCONFINED_BACKENDS:
            raise SandboxOverrideRefused(
                "job.sandbox.backend='local' runs tools on the host without isolation and is never "
                "selectable by a job; the operator picks it with the setting sandbox_backend")

    def apply(self, spec: SandboxSpec, overrides: Mapping[str, object] | None) -> SandboxSpec:
        """`spec` with the job's `overrides` merged in, validated, or SandboxOverrideRefused; its
        image (the task's, often taken from the instance, or the job's) checked by `check_image`."""
        result = self._merged(spec, overrides) if overrides else spec
        self.check_image(result.image, "job.sandbox.image" if overrides and "image" in overrides else "image")
        for service in result.services:  # a task's sidecars (a compose file's image) pass the same list
            self.check_image(service.image, f"services.{service.name}.image")
        return result

    def _merged(self, spec: SandboxSpec, overrides: Mapping[str, object]) -> SandboxSpec:
        self.check_fields(overrides)
        merged = spec.model_dump()
        for name, value in overrides.items():
            if name == "limits" and isinstance(value, dict):
                merged["limits"] = {**merged["limits"], **value}
            else:
                merged[name] = value
        try:
            result = SandboxSpec.model_validate(merged)
        except ValidationError as error:
            raise SandboxOverrideRefused(f"job.sandbox does not make a valid sandbox spec: {error}") from None
        if not self.may_raise_limits:
            self._only_lowered(spec, result)
        if result.setup_commands != spec.setup_commands and result.backend in _UNCONFINED_BACKENDS:
            raise SandboxOverrideRefused(
                "job.sandbox.setup_commands would run on the host: this task's sandbox uses the unisolated "
                "'local' backend, which only the operator's own setup may use")
        return result

    def check_image(self, image: str | None, field: str = "image") -> None:
        """Refuse an image the operator did not allow: a host path not strictly beneath one of
        `image_folders` (symlinks resolved), or a reference not on `images`. None (bwrap on the
        host's own rootfs, read-only, with its masks) is the operator's default and passes."""
        if image is None:
            return
        if image.startswith("/"):
            real = os.path.realpath(image)
            for folder in self.image_folders or (default_images_dir(),):
                root = os.path.realpath(folder).rstrip("/")
                if real.startswith(root + "/") and real != root:
                    return
            raise SandboxOverrideRefused(
                f"{field}={image!r} is a host path outside the operator's image folders "
                f"({', '.join(self.image_folders or (default_images_dir(),))}); a job's sandbox starts from a "
                f"rootfs the image cache holds (rollstream images pull/build) or a folder the operator lists in "
                f"{FOLDERS_SETTING}")
        if not _REFERENCE.fullmatch(image) or any(part in (".", "..") for part in image.split("/")):
            raise SandboxOverrideRefused(
                f"{field}={image!r} is neither an absolute host path nor an image reference such as "
                "'localhost/rollstream/env:TAG' (no leading '-' or '.', no space, no '..')")
        if not any(_admits(entry, image) for entry in self.images):
            raise SandboxOverrideRefused(
                f"{field}={image!r} is not among the images the operator allows ({', '.join(self.images) or 'none'});"
                f" add it, or a prefix ending in '/' or ':', to {IMAGES_SETTING}")

    def _only_lowered(self, base: SandboxSpec, result: SandboxSpec) -> None:
        pairs = [(f"limits.{name}", getattr(base.limits, name), getattr(result.limits, name))
                 for name in SandboxLimits.model_fields]
        pairs += [(name, getattr(base, name), getattr(result, name)) for name in _BUDGET_FIELDS]
        for name, before, after in pairs:
            if _raised(before, after):
                raise SandboxOverrideRefused(
                    f"job.sandbox.{name}={after!r} raises the task's limit {before!r}; a job may only lower "
                    f"limits unless the operator sets {RAISE_SETTING}")


def _raised(before: Any, after: Any) -> bool:
    """None means unlimited; anything else compares as a number."""
    if after is None:
        return before is not None
    return before is not None and after > before


def _admits(entry: str, image: str) -> bool:
    """An allow-list entry admits an image: '*' any, a prefix ending in '/' or ':' what begins
    with it, another entry only that image."""
    if entry == "*":
        return True
    return image.startswith(entry) if entry.endswith(("/", ":")) else image == entry
