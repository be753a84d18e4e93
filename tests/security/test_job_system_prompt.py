"""Issue #32, finding 9: a job's `system_prompt` went through `str.format`, so a field's width
(`{repo_dir:>200000000}`) made the worker build a string of hundreds of megabytes, and attribute
fields (`{repo_dir.__class__}`) reached into the value's object. Only bare `{name}` fields of the
names a task fills are filled now; anything else fails the job at submit."""

from __future__ import annotations

import pytest

from rollstream.errors import InvalidJob
from rollstream.tasks.code import CodeTask
from rollstream.tasks.swe import SweTask, load_instances

SWE = load_instances()[0]
CODE = {"prompt": "Write add(a, b)", "tests": ["assert add(1, 2) == 3"], "entry_point": "add"}
HOSTILE = ["{repo_dir:>200000000}", "{repo_dir:.{0}}", "{repo_dir.__class__.__mro__}", "{repo_dir[0]}",
           "{repo_dir!r}", "{0}", "{}", "{unknown}", "{repo_dir", "}"]


@pytest.mark.parametrize("prompt", HOSTILE)
def test_a_swe_system_prompt_with_a_format_spec_or_foreign_field_is_refused_at_submit(prompt):
    with pytest.raises(InvalidJob, match="system_prompt"):
        SweTask().validate({**SWE, "system_prompt": prompt})
    with pytest.raises(InvalidJob, match="system_prompt"):
        SweTask().prompt_messages({**SWE, "system_prompt": prompt})


@pytest.mark.parametrize("prompt", ["{file:>200000000}", "{file.__class__}", "{file!a}"])
def test_a_code_system_prompt_with_a_format_spec_is_refused_at_submit(prompt):
    with pytest.raises(InvalidJob, match="system_prompt"):
        CodeTask().validate({**CODE, "system_prompt": prompt})


def test_bare_fields_and_doubled_braces_fill_as_before():
    swe = SweTask().prompt_messages({**SWE, "system_prompt": "Repo at {repo_dir}; JSON looks like {{\"a\": 1}}."})
    assert swe[0]["content"] == 'Repo at /workspace/calc; JSON looks like {"a": 1}.'.replace(
        "calc", SWE["repo"].split("/")[-1])
    code = CodeTask().prompt_messages({**CODE, "system_prompt": "Write {file}."})
    assert code[0]["content"] == "Write solution.py."
