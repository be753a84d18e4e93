"""Records as the SWE datasets publish them load into the swe task: repo forms, field names
and JSON-string lists of SWE-bench, SWE-Gym, SWE-smith and R2E-Gym; anything else fails
with an error naming the field."""

from __future__ import annotations

import json
import subprocess

import pytest

from rollstream.errors import InvalidJob
from rollstream.tasks import swe_env, swe_records
from rollstream.tasks.swe import SweTask, load_instances

CALC = next(i for i in load_instances() if i["repo"] == "rollstream/minicalc")


@pytest.mark.parametrize("repo", [
    "psf/requests",
    "https://github.com/psf/requests",
    "https://github.com/psf/requests.git",
    "git@github.com:psf/requests.git",
    "ssh://git@github.com/psf/requests.git",
])
def test_repo_in_any_remote_form_maps_to_owner_and_name(repo):
    assert swe_records.repo_ref(repo).name == "psf/requests"


def test_a_local_clone_is_its_own_mirror_entry(tmp_path):
    clone = tmp_path / "my-project.git"
    subprocess.run(["git", "init", "-q", "--bare", str(clone)], check=True)
    ref = swe_records.repo_ref(str(clone))
    assert ref.name == "local/my-project" and ref.path == clone
    assert swe_records.normalize({**CALC, "repo": f"file://{clone}"})["repo_path"] == str(clone)


def test_swe_bench_record_with_json_string_lists_loads():
    record = {**CALC, "FAIL_TO_PASS": json.dumps(CALC["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps([]),
              "environment_setup_commit": CALC["base_commit"], "hints_text": "", "version": "0.1"}
    SweTask().validate(record)
    inst = swe_records.normalize(record)
    assert inst["FAIL_TO_PASS"] == CALC["FAIL_TO_PASS"] and inst["PASS_TO_PASS"] == []
    assert swe_env.env_recipe(inst) is None  # environment_setup_commit alone asks for no build


def test_swe_smith_record_without_test_patch_loads():
    record = {"instance_id": "oauthlib__oauthlib.1fd52536.combine_file__0q7n3z7k",
              "repo": "swesmith/oauthlib__oauthlib.1fd52536",
              "base_commit": "0123456789abcdef0123456789abcdef01234567", "patch": "", "problem_statement": "bug",
              "image_name": "jyangballin/swesmith.x86_64.oauthlib_1776_oauthlib.1fd52536",
              "FAIL_TO_PASS": ["tests/test_a.py::test_x"], "PASS_TO_PASS": ["tests/test_a.py::test_y"]}
    SweTask().validate(record)
    inst = swe_records.normalize(record)
    assert inst["test_patch"] == "" and inst["image"] == record["image_name"]
    assert SweTask().sandbox_spec(record).image == record["image_name"]


def test_r2e_gym_field_names_load():
    record = {"instance_id": "r2e-1", "repo_name": "https://github.com/pandas-dev/pandas",
              "commit_hash": "abcdef1234567", "docker_image": "namanjain12/pandas_final:abcdef",
              "problem_statement": "x", "FAIL_TO_PASS": "[\"t.py::a\"]", "PASS_TO_PASS": "[]"}
    SweTask().validate(record)
    inst = swe_records.normalize(record)
    assert (inst["repo"], inst["base_commit"], inst["image"]) == ("pandas-dev/pandas", "abcdef1234567",
                                                                  "namanjain12/pandas_final:abcdef")


@pytest.mark.parametrize("change, field", [
    ({"repo": "not a repo"}, "repo"),
    ({"repo": "/does/not/exist"}, "repo"),
    ({"FAIL_TO_PASS": "t.py::a"}, "FAIL_TO_PASS"),
    ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS"),
    ({"environment": {"pip_packages": 5}}, "pip_packages"),
    ({"environment": {"python_version": "3.9"}}, "environment"),
    ({"environment": "python3.9"}, "environment"),
])
def test_a_record_that_cannot_load_names_the_field(change, field):
    with pytest.raises(InvalidJob, match=field):
        SweTask().validate({**CALC, **change})


def test_a_record_without_a_repository_says_which_names_it_looked_for():
    record = {k: v for k, v in CALC.items() if k != "repo"}
    with pytest.raises(InvalidJob, match="repo_name"):
        SweTask().validate(record)


def test_recipe_key_follows_content_and_siblings_share_an_image():
    recipe = {"environment": {"pip_packages": ["pytest==8.3.3"], "python": "3.11"}}
    first = swe_env.env_recipe(swe_records.normalize({**CALC, **recipe}))
    sibling = swe_env.env_recipe(swe_records.normalize({**CALC, **recipe, "instance_id": "other",
                                                        "problem_statement": "another issue"}))
    changed = swe_env.env_recipe(swe_records.normalize({**CALC, "environment": {"pip_packages": ["pytest==8.3.2"]}}))
    assert first.tag == sibling.tag and first.tag != changed.tag
    spec = SweTask().sandbox_spec({**CALC, **recipe})
    assert spec.image == first.tag and spec.env["PATH"].startswith("/opt/rs-env/bin:")
