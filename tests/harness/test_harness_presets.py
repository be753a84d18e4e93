"""Presets as a user writes and lists them: `rollstream harnesses list` shows rollstream's own and
the operator's (ROLLSTREAM_HARNESS_PRESET_DIRS, theirs winning a name), each with where it is
installed; a preset that would be unsafe or ambiguous (an unpinned package, a name that is not its
file's, an API the door does not serve) is refused with the file and the field named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollstream.agent.presets import PresetError, find_preset, load_preset


def _harnesses(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollstream", "harnesses", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})}, check=False)


def test_harnesses_list_shows_the_shipped_preset_and_an_operators_own(tmp_path):
    (tmp_path / "my-agent.toml").write_text('name = "my-agent"\napi = "openai-chat"\n[run]\nargv = ["sh"]\n')
    listed = _harnesses("list", "--json", env={"ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(tmp_path)])})
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in map(json.loads, listed.stdout.splitlines())}
    mini = rows["mini-swe-agent"]
    assert mini["package"] == "mini-swe-agent==2.4.6" and mini["api"] == "openai-chat"
    assert mini["host"] == os.path.isfile(f"{mini['prefix']}/bin/mini")  # where it is installed, as it is
    assert rows["my-agent"]["file"] == str(tmp_path / "my-agent.toml") and rows["my-agent"]["package"] is None


def test_an_operators_preset_of_a_shipped_name_wins(tmp_path):
    (tmp_path / "mini-swe-agent.toml").write_text('name = "mini-swe-agent"\napi = "openai-chat"\n[run]\n'
                                                  'argv = ["my-mini"]\n')
    assert find_preset("mini-swe-agent", [tmp_path]).argv == ["my-mini"]
    assert find_preset("mini-swe-agent").argv[0].endswith("/bin/mini")


@pytest.mark.parametrize(("text", "said"), [
    ('name = "p"\napi = "openai-chat"\n[install]\npypi = "mini-swe-agent"\nprefix = "/opt/p"\n[run]\nargv = ["x"]\n',
     "must pin one version"),
    ('name = "q"\napi = "openai-chat"\n[run]\nargv = ["x"]\n', "must be the file's own name"),
    ('name = "p"\napi = "gemini"\n[run]\nargv = ["x"]\n', "is not served by the door"),
    ('name = "p"\napi = "openai-chat"\n[run]\nargv = "mini --task x"\n', "run.argv must be a list"),
    ('name = "p"\napi = "openai-chat"\n[install]\npypi = "a==1"\nprefix = "opt/../x"\n[run]\nargv = ["x"]\n',
     "install.prefix must be an absolute path"),
])
def test_a_preset_that_cannot_be_used_is_refused_naming_its_file_and_field(tmp_path, text, said):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(PresetError, match=said) as refused:
        load_preset(path)
    assert str(path) in str(refused.value)
