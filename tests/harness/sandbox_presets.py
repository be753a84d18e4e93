"""Harness presets of the tests (written as an operator writes one: a TOML file in a folder named
by ROLLSTREAM_HARNESS_PRESET_DIRS), each a small command that behaves one way inside its sandbox."""

from __future__ import annotations

import json
from pathlib import Path

# Asks the door once, through the relay, as any OpenAI client would (its base URL and key from the
# environment the preset sets), then answers the arith question itself: its answer is scored.
DOOR_CLIENT = '''
import json, os, re, sys, urllib.request
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": sys.argv[1]}],
                     "max_tokens": 16}).encode(),
    headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
with urllib.request.urlopen(request, timeout=300) as response:
    reply = json.load(response)
print("the model said:", repr(reply["choices"][0]["message"]["content"][:60]))
a, op, b = re.search(r"(-?\\d+) ([-+*]) (-?\\d+)", sys.argv[1]).groups()
print({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op])
'''

OPENAI_ENV = {"OPENAI_BASE_URL": "{door_url}", "OPENAI_API_KEY": "{door_key}", "OPENAI_MODEL": "{model}"}


def _toml(name: str, argv: list[str], files: dict[str, str] | None = None, env: dict[str, str] | None = None) -> str:
    lines = [f'name = "{name}"', 'api = "openai-chat"', f'description = "test preset {name}"', "", "[run]",
             f"argv = {json.dumps(argv)}", "", "[run.env]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in (env or OPENAI_ENV).items()]
    for path, content in (files or {}).items():
        lines += ["", "[[files]]", f"path = {json.dumps(path)}", f"content = {json.dumps(content)}"]
    return "\n".join(lines) + "\n"


PRESETS = {
    "door-client": _toml("door-client", ["python3", "{harness_dir}/client.py", "{instruction}"],
                         {"{harness_dir}/client.py": DOOR_CLIENT}),
    # Never ends (a marker in its command line shows whether it outlived its job).
    "hangs": _toml("hangs", ["sh", "-c", "exec sleep 1001"]),
    # 64 MiB of output, then an answer.
    "floods": _toml("floods", ["sh", "-c", "yes flood | head -c 67108864; echo; echo 5"]),
    # Leaves a process of its own session behind (setsid), then exits as if done.
    "forks-away": _toml("forks-away", ["sh", "-c", ("setsid sh -c 'exec sleep 1002' </dev/null >/dev/null 2>&1 & "
                                                    "echo 5")]),
    "exits-at-once": _toml("exits-at-once", ["sh", "-c", "echo giving up >&2; exit 3"]),
    "not-installed": _toml("not-installed", ["/opt/nowhere/bin/agent", "{instruction}"]),
}


def write_presets(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in PRESETS.items():
        (folder / f"{name}.toml").write_text(text)
    return folder


def installed_preset(name: str):
    """The shipped preset ``name``, installed on this host before the tests (scripts/install-harnesses,
    which scripts/test runs; its models are tests/model_cache.py's): never installed in a test."""
    from rollstream.agent.presets import find_preset

    preset = find_preset(name)
    assert preset is not None and preset.installed_on_host(), f"run scripts/install-harnesses {name}"
    return preset


SWE_ID = "rollstream__inventory-1"  # the shipped SWE instance the harness tests fix (one edit of store.py)
# The fix of the SWE instance as one command, silent wherever it runs (a capture on a host finds no checkout).
SWE_FIX = ("cd /workspace/inventory 2>/dev/null && python3 -c 'p = \"inventory/store.py\"; s = open(p).read(); "
           "open(p, \"w\").write(s.replace(\"self._stock[item] = self._stock.get(item, 0) - qty\", "
           "\"have = self._stock.get(item, 0)\\n        if qty > have:\\n            raise InsufficientStock(item)"
           "\\n        self._stock[item] = have - qty\"))'; true")


def swe_instance() -> dict:
    from rollstream.tasks.swe import load_instances

    return next(i for i in load_instances() if i["instance_id"] == SWE_ID)


def swe_job(mirror: str, agent: dict) -> dict:
    """A job on the shipped SWE instance, greedy, its repository mirrored into ``mirror``."""
    instance = {**swe_instance(), "repo_mirror": mirror}
    return {"task": "swe", "instance": instance, "sampling": {"temperature": 0.0, "max_tokens": 384},
            "agent": {**agent, "max_tokens_per_turn": 384}}


def assert_fixed_and_scored(result) -> None:
    """The harness's two calls (an edit, then done) left a diff the instance's hidden tests pass."""
    assert result.status == "completed", result.error
    traj = result.trajectory
    assert traj.finish_reason == "stop" and traj.extra["harness_run"]["exit_code"] == 0, traj.extra["harness_run"]
    assert len(traj.extra["calls"]) == 2 and "InsufficientStock" in traj.response_text
    assert result.reward == 1.0, traj.extra["eval"]  # the hidden tests pass on the diff it left
