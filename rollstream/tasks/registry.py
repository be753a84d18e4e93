"""Finding tasks by name: Python entry points in the group ``rollstream.tasks`` (so a
user's package can add its own), plus tasks registered in-process."""

from __future__ import annotations

import logging
from functools import cache
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path

from rollstream.errors import InvalidJob, UnknownTask
from rollstream.tasks.base import Task

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rollstream.tasks"
_registered: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register a task class in this process (usable as a decorator)."""
    _registered[cls.name] = cls
    _instances.cache_clear()
    return cls


def shipped_task_sets() -> dict[str, Path]:
    """The task files inside the package (``rollstream/data/tasks/NAME.jsonl``) by name."""
    folder = resources.files("rollstream") / "data" / "tasks"
    return {Path(str(f)).stem: Path(str(f)) for f in folder.iterdir() if str(f).endswith(".jsonl")}


def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_tasks() -> list[str]:
    return sorted(set(_registered) | set(_entry_points()))


@cache
def _instances(name: str) -> Task:
    if name in _registered:
        return _registered[name]()
    ep = _entry_points().get(name)
    if ep is None:
        raise UnknownTask(f"unknown task '{name}'; installed tasks: {', '.join(available_tasks()) or 'none'}. "
                          f"A package adds tasks through the '{ENTRY_POINT_GROUP}' entry point group")
    cls = ep.load()  # type: ignore[attr-defined]
    return cls()


def get_task(name: str) -> Task:
    return _instances(name)


def validate_instance(task_name: str, instance: dict) -> None:
    """Raise ``UnknownTask``/``InvalidJob`` if the job cannot run."""
    task = get_task(task_name)
    try:
        task.validate(instance)
    except InvalidJob:
        raise
    except Exception as exc:  # a task's own validator failing is still the job's fault
        raise InvalidJob(f"task '{task_name}' rejected the instance: {exc}") from exc
