"""The shipped task files are what ``rollstream submit`` reads: one job per line, each
valid for its task."""

from __future__ import annotations

import json

import pytest

from rollstream.messages import Job
from rollstream.tasks.arith import ArithTask
from rollstream.tasks.code import CodeTask
from rollstream.tasks.echo import EchoTask
from rollstream.tasks.math import MathTask
from rollstream.tasks.swe import SweTask

from .conftest import data_file

TASKS = {"math": MathTask, "code": CodeTask, "swe": SweTask, "arith": ArithTask, "echo": EchoTask}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_line_of_a_shipped_task_file_is_a_valid_job(name):
    lines = data_file(f"{name}.jsonl").read_text().splitlines()
    assert len(lines) >= 3
    for line in lines:
        job = Job.model_validate(json.loads(line))
        assert job.task == name
        TASKS[name]().validate(job.instance)


def test_prompts_show_the_agent_the_task_but_never_the_answer():
    for name, cls in TASKS.items():
        for line in data_file(f"{name}.jsonl").read_text().splitlines():
            inst = json.loads(line)["instance"]
            if not hasattr(cls, "prompt_messages"):
                continue  # echo has no prompt for a model
            text = json.dumps(cls().prompt_messages(inst))
            secret = {"arith": None, "math": None, "code": inst.get("reference_solution"),
                      "swe": inst.get("patch")}[name]
            assert secret is None or json.dumps(secret)[1:-1] not in text
