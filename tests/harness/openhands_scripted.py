"""The OpenHands SDK preset in the tests: its "lean" variant, and the tiny models that have learnt one
episode of it by heart (built by tests/model_cache.py, never in a test).

The SDK's own system prompt and five tools come to ~9k tokens, past a tiny CPU model's 4096
positions. The tests run the shipped preset with options its runner offers added (as an operator
writes a preset of their own): a short system prompt, the terminal tool alone with the finish tool,
so that its prompt fits. The model learns the calls the door renders for it (door_capture.py: the
runner, on this host, against a door answering the script): a terminal call, then finish with the
answer (arith); an edit of the checkout by one command, then finish (a shipped SWE instance). The
command of each episode prints nothing on this host and in the sandbox alike, so the observation
the model learns is the one it will see but for the folder names, which it learns to pass over
(two captures from folders of different names, with different PATHs)."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from rollstream.agent.gateway import MODEL_NAME
from rollstream.agent.presets import driver_source, find_preset, install_on_host, load_preset
from rollstream.sandboxes.backends.common import host_python_path
from rollstream.tasks import arith

from .sandbox_presets import SWE_FIX, swe_instance

PRESET = "openhands-sdk"
LEAN = "openhands-sdk-lean"
SYSTEM = "You are a coding agent in a sandbox. Use the terminal tool, then call finish with the result alone."
LEAN_ARGS = ["--tools", "terminal", "--no-think-tool", "--system-prompt-file", "{harness_dir}/system.j2"]
ARITH_INSTANCE = {"a": 12, "op": "+", "b": 30}


def tool_call(name: str, arguments: dict) -> str:
    """A tool call as the served model writes it (the template's Hermes form, agent/parsing.py)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


REPLIES = {"arith": [tool_call("terminal", {"command": "echo $((12+30)) >/dev/null"}),
                     tool_call("finish", {"message": "42"})],
           "swe": [tool_call("terminal", {"command": SWE_FIX}), tool_call("finish", {"message": "Fixed."})]}


def lean_preset_text() -> str:
    """The shipped preset's file with the lean options before its task, under its own name, and the
    short system prompt as a file it writes into the sandbox."""
    text = find_preset(PRESET).source.read_text()
    text = text.replace(f'name = "{PRESET}"', f'name = "{LEAN}"', 1)
    task = '"--task", "{instruction}"]'
    assert task in text, "the shipped preset's argv ends with its task"
    text = text.replace(task, ", ".join(json.dumps(a) for a in LEAN_ARGS) + ", " + task, 1)
    return text + f'\n[[files]]\npath = "{{harness_dir}}/system.j2"\ncontent = {json.dumps(SYSTEM)}\n'


def write_lean_preset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{LEAN}.toml").write_text(lean_preset_text())
    return folder


def _instructions() -> dict[str, str]:
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.tasks.swe import SweTask

    swe = swe_instance()
    return {"arith": arith.question(**ARITH_INSTANCE), "swe": instruction_of(SweTask().prompt_messages(swe))}


def trained_folder(parent: Path, which: str) -> Path:
    """Where the model of episode ``which`` ('arith', 'swe') is kept: named by the preset, the
    episode, the runner and this file, so a change to any trains anew; the arith model also by the
    PATH of a bwrap sandbox on the host's root, whose first folder is this interpreter's: the
    terminal names the interpreter in every observation (`[Python interpreter: …/bin/python]`), so a
    model learnt from one checkout's venv does not answer in another's (CI's clone in its own folder
    shares this cache); and by whether a podman engine answers, whose capture it then learns too (a
    model built while the engine was down learnt bwrap's episode alone, and failed the podman jobs)."""
    from rollstream.sandboxes.backends.docker import DockerBackend

    parts = [lean_preset_text(), json.dumps([_instructions()[which], REPLIES[which]]),
             driver_source("openhands").read_text(), Path(__file__).read_text()]
    if which == "arith":
        parts += [host_python_path(), f"container engine: {DockerBackend().available()}"]
    return parent / f"openhands-{which}-{hashlib.sha1(chr(10).join(parts).encode()).hexdigest()[:12]}"


def build(parent: Path, which: str, steps: int = 300) -> Path:
    """Install the preset (once), capture the episode through a scripted door (in the sandbox, or
    twice from two folders on this host), and train the tiny model on the door's renderings of each
    call (prompt, then reply)."""
    from .episode_model import train_episode

    return train_episode(trained_folder(parent, which), parent / "base",
                         lambda tokenizer: episode_examples(tokenizer, which), steps)


def episode_examples(tokenizer, which: str) -> list[tuple[list[int], list[int]]]:
    """The episode's calls as the door rendered them (prompt, then the scripted reply: mask 1),
    the preset installed on this host first (once)."""
    install_on_host(find_preset(PRESET))
    return _sandbox_examples(tokenizer) if which == "arith" else _host_examples(tokenizer, which)


def _examples(captured, which: str) -> list[tuple[list[int], list[int]]]:
    if len(captured.prompts) != len(REPLIES[which]) or captured.exit_code != 0:
        raise RuntimeError(f"{PRESET} made {len(captured.prompts)} calls (the episode has {len(REPLIES[which])}) "
                           f"and exited {captured.exit_code}:\n{captured.output[-3000:]}")
    return [(prompt + reply, [0] * len(prompt) + [1] * len(reply))
            for prompt, reply in zip(captured.prompts, captured.replies)]


def _sandbox_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """The arith episode captured where a job runs it (a sandbox of the task's spec, the run
    stage's own launch): in bwrap, and in podman from the preset's image where an engine answers,
    whose terminal says less of its surroundings (no `python` on its PATH). The prompts the model
    learns are then those it is given in the tests, to the byte: captures on this host differed
    from the sandbox's in the terminal's working folder and interpreter, and a model that had to
    pass over them answered `</tool_call>` on CI."""
    from rollstream.agent.presets import build_image
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.sandboxes.backends.docker import DockerBackend
    from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
    from rollstream.tasks.arith import ArithTask

    from .door_capture import capture_in_sandbox

    examples = []
    spec = ArithTask().sandbox_spec(ARITH_INSTANCE)
    where = [("bwrap", spec)]
    if DockerBackend().available():
        image = build_image(find_preset(PRESET), DEFAULT_BASE_IMAGE)  # once (scripts/install-harnesses)
        where.append(("docker", spec.model_copy(update={"image": image})))
    for backend, spec in where:
        with tempfile.TemporaryDirectory(prefix="rs-capture-") as scratch:
            lean = load_preset(write_lean_preset(Path(scratch)) / f"{LEAN}.toml")
            instruction = instruction_of(ArithTask().prompt_messages(ARITH_INSTANCE))
            captured = capture_in_sandbox(tokenizer, REPLIES["arith"], lean, instruction, spec, backend=backend)
        examples += _examples(captured, "arith")
    return examples


def _host_examples(tokenizer, which: str) -> list[tuple[list[int], list[int]]]:
    """The episode captured twice on this host, from folders of different names with different
    PATHs, so that the model learns to pass over the folder the SWE checkout is in."""
    from .door_capture import capture

    examples = []
    for folder_name, path in (("work", None), ("workspace-of-a-sandbox", "/usr/local/bin:/usr/bin:/bin")):
        with tempfile.TemporaryDirectory(prefix="rs-capture-") as scratch:
            lean = load_preset(write_lean_preset(Path(scratch, "presets")) / f"{LEAN}.toml")
            harness_dir, workdir = Path(scratch, "harness"), Path(scratch, folder_name)
            workdir.mkdir()
            harness_dir.mkdir()
            values = {"model": MODEL_NAME, "harness_dir": str(harness_dir), "instruction": _instructions()[which],
                      "driver": str(driver_source("openhands"))}

            def fill(text: str, values: dict = values) -> str:
                for name, value in values.items():
                    text = text.replace("{" + name + "}", value)
                return text

            for extra in lean.files:
                Path(fill(extra.path)).write_text(fill(extra.content))
            captured = capture(tokenizer, REPLIES[which], [fill(a) for a in lean.argv],
                               {k: fill(v) for k, v in lean.env.items()} | ({"PATH": path} if path else {}), workdir)
        examples += _examples(captured, which)
    return examples
