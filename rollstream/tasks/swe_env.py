"""An SWE instance's environment: its published image, or a recipe in the SWE-bench harness's
style turned into an EnvRecipe (sandboxes/env_images.py) that `rollstream images build`
builds once and every rollout of the instance (and of its siblings) starts from.

Recipe fields, at the top level of the record or under ``environment``: ``base_image``,
``python`` (version), ``pre_install`` (shell commands), ``pip_packages``, ``install``
(run in the checkout; default ``python -m pip install -e .``) and
``environment_setup_commit`` (default ``base_commit``).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from rollstream.errors import InvalidJob
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE, EnvRecipe, build_env_image
from rollstream.sandboxes.images import deduplicate
from rollstream.tasks import swe_records, swe_repos

RECIPE_FIELDS = ("base_image", "python", "pre_install", "pip_packages", "install", "environment_setup_commit")
# environment_setup_commit alone does not ask for a build: SWE-bench records always carry it.
_BUILD_TRIGGERS = ("base_image", "python", "pre_install", "pip_packages", "install")
DEFAULT_WORKDIR = "/workspace"


def _as_list(value: object, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise InvalidJob(f"swe: environment field {field} must be a string or a list of strings")


def recipe_fields(inst: dict) -> dict | None:
    """The recipe part of a canonical record, or None when it names no recipe."""
    nested = inst.get("environment")
    if nested is not None and not isinstance(nested, dict):
        raise InvalidJob("swe: environment must be an object with recipe fields "
                         f"({', '.join(RECIPE_FIELDS)})")
    fields = {**{k: inst[k] for k in RECIPE_FIELDS if k in inst}, **(nested or {})}
    unknown = sorted(set(nested or {}) - set(RECIPE_FIELDS))
    if unknown:
        raise InvalidJob(f"swe: environment has unknown fields {unknown}; it takes {list(RECIPE_FIELDS)}")
    if nested is None and not any(k in inst for k in _BUILD_TRIGGERS):
        return None
    return fields


def repo_dir(inst: dict, workdir: str = DEFAULT_WORKDIR) -> str:
    """Where the checkout is inside the sandbox: ``repo_dir`` of the record (a published image's
    own checkout, such as SWE-bench's /testbed), else a folder named after the repo under
    the workdir (not the workdir itself, which is also $HOME)."""
    if inst.get("repo_dir"):
        return str(inst["repo_dir"])
    return str(PurePosixPath(workdir) / inst["repo"].split("/")[-1])


def env_recipe(inst: dict, workdir: str = DEFAULT_WORKDIR) -> EnvRecipe | None:
    """The EnvRecipe of a canonical record, or None."""
    fields = recipe_fields(inst)
    if fields is None:
        return None
    install = fields.get("install", "python -m pip install -e .")
    if not isinstance(install, str):
        raise InvalidJob("swe: environment field install must be a shell command string")
    for name in ("base_image", "python", "environment_setup_commit"):
        if name in fields and not isinstance(fields[name], str):
            raise InvalidJob(f"swe: environment field {name} must be a string")
    return EnvRecipe(
        base_image=fields.get("base_image") or DEFAULT_BASE_IMAGE,
        python=fields.get("python"),
        pre_install=_as_list(fields.get("pre_install"), "pre_install"),
        pip_packages=_as_list(fields.get("pip_packages"), "pip_packages"),
        install=install,
        repo=inst["repo"],
        commit=fields.get("environment_setup_commit") or inst["base_commit"],
        repo_dir=repo_dir(inst, workdir),
    )


def sandbox_image(inst: dict, workdir: str = DEFAULT_WORKDIR) -> str | None:
    """The image a rollout of this record starts from: built from its recipe, else its own."""
    recipe = env_recipe(inst, workdir)
    if recipe is not None:
        return recipe.tag
    return inst.get("image") or None


def build_for_instances(instances: list[dict], mirror: Path, backends: tuple[str, ...],
                        images_dir: str | None = None, force: bool = False) -> list[dict]:
    """Build each distinct recipe of `instances` once; one summary dict per environment."""
    seen: dict[str, dict] = {}
    exported = False  # a rootfs was (re)made: link its files with the others'
    # `mirror` is the operator's (the command line); an instance's own repo_mirror and local
    # repository path must lie beneath it or the folders the operator allows jobs.
    roots = swe_repos.MirrorRoots.from_settings().with_root(mirror)
    for record in instances:
        inst = swe_records.normalize(record)
        recipe = env_recipe(inst)
        if recipe is None or recipe.key() in seen:
            if recipe is not None:
                seen[recipe.key()]["instances"].append(inst["instance_id"])
            continue
        entry = swe_repos.locate(inst["repo"], Path(inst.get("repo_mirror") or mirror), inst.get("repo_path"), roots)
        if entry.suffix == ".bundle":
            swe_repos.open_bundle(entry, roots).close()  # a plain file beneath its root, not a symlink
        built = build_env_image(recipe, str(entry), backends, images_dir, force=force)
        seen[recipe.key()] = {**built.to_dict(), "instances": [inst["instance_id"]]}
        exported = exported or built.rootfs_made
    if exported:
        deduplicate(images_dir)
    return list(seen.values())
