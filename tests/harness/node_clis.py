"""The Node.js coding CLIs of the shipped presets (Qwen Code, OpenCode, Codex, Claude Code) in the
tests: each CLI's "lean" variant, and the tiny model that has learnt one arith episode of it.

A CLI's own system prompt and tool schemas run to tens of thousands of tokens, past what a tiny CPU
model can take (4096 positions) or learn in minutes. The tests run each shipped preset's CLI as it is,
with options the CLI itself offers added (written as an operator writes a preset of their own: a
short system prompt, its shell tool alone, no startup discovery), so that its prompt fits. The model
learns the calls the door renders for that CLI (tests/harness/door_capture.py: the CLI, on this
host, against a door answering the script): a shell call that computes, then the answer.

The CLIs tell the model today's date, and a model learnt by heart on one date misses its turns on
another (tried: re-rendered with another date, Qwen Code's model answered before calling its tool
on 8 of 10 dates; trained on four dates, it still missed 19 of 40 unseen ones). Claude Code says it
last in its system prompt ("Today's date is 2026-11-27.", Bun's Date), OpenCode in its <env> block
(Bun's Date.toDateString()), Qwen Code in its startup context and a reminder (Node's Date,
toLocaleDateString en-US long), Codex in <environment_context> (<current_date>, <timezone>; a static
Rust binary: no preload reaches its clock). So the lean variants show them one fixed day, each by a
way the CLI or its runtime offers: Codex's own config drops the date (include_environment_context_time);
the JS CLIs' runtime first loads FIXED_DATE_JS (Node: NODE_OPTIONS --require; Bun: BUN_OPTIONS
--preload; OpenCode, a Bun binary that reads neither, as a plugin of its config), which sets that
process's Date, and nothing else of its clock, to FIXED_DAY. The models then hold on any day."""

from __future__ import annotations

import datetime
import hashlib
import json
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from rollstream.agent.presets import find_preset, install_on_host

from .sandbox_presets import SWE_FIX

INSTANCE = {"a": 12, "op": "+", "b": 30}
# A CLI reserves far more address space than it uses (V8's code range and heap, a worker or a relaunch
# of itself; Bun's JavaScriptCore more still): the arith task's 512 MiB per process (RLIMIT_AS) cannot
# start it. Each CLI names the address space it needs (Cli.memory_mb).
LIMITS = {"cpu_time_s": 600, "default_timeout_s": 60, "default_no_output_timeout_s": 60, "idle_timeout_s": 600}
RECIPE = 2  # bump when the way the models are built changes (their folders are then built anew)
SYSTEM = "You are a coding agent in a sandbox. Use the shell tool, then answer with the result alone."
FIXED_DAY = datetime.date(2026, 1, 1)  # the day the JS CLIs see (noon UTC: that day in every zone from -11 to +11)
# This process's Date from its start: FIXED_DAY at noon UTC, then running as the real clock runs (a
# constant shift: durations measured with Date stay true). Timers and performance.now() are untouched.
FIXED_DATE_JS = f"""// rollstream's tests: this process's Date starts at noon UTC on {FIXED_DAY.isoformat()}.
const RealDate = Date;
const shift = RealDate.UTC({FIXED_DAY.year}, {FIXED_DAY.month - 1}, {FIXED_DAY.day}, 12) - RealDate.now();
const now = () => RealDate.now() + shift;
globalThis.Date = new Proxy(RealDate, {{
  construct: (target, args, newTarget) => Reflect.construct(target, args.length ? args : [now()], newTarget),
  apply: () => new RealDate(now()).toString(),
  get: (target, key) => (key === "now" ? now : Reflect.get(target, key)),
}});
"""
FIXED_DATE_FILE = ("{harness_dir}/fixed-date.js", FIXED_DATE_JS)


def shell_call(name: str, arguments: dict) -> str:
    """A tool call as the served model writes it (the template's Hermes form, agent/parsing.py)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@dataclass(frozen=True)
class Cli:
    preset: str  # the shipped preset's name
    tool: str  # its shell tool, which the episode calls
    program_args: int  # how many of the preset's argv items start the CLI (`... --version` asks its version)
    lean_args: tuple[str, ...] = ()  # the CLI's own options that make its prompt fit a tiny model
    lean_config: str = ""  # JSON merged into the preset's JSON config file (its first [[files]] entry)
    memory_mb: int = 4096  # the sandbox's address space per process it needs to start and run
    lean_files: tuple[tuple[str, str], ...] = ()  # (path, content) files the lean options name
    # (name, value) environment the lean variant adds: appended (after a space) to the preset's value
    # of that variable where it sets one (NODE_OPTIONS), else set.
    lean_env: tuple[tuple[str, str], ...] = ()
    # The context its SWE job is served (the tiny model's config names 4096 positions; its rotary
    # positions have no table to run out of, and a CLI whose SWE episode runs longer learnt it past 4096).
    swe_context_tokens: int = 4096

    @property
    def limits(self) -> dict:
        """The sandbox limits of its jobs (the arith task's, with room for the CLI)."""
        return {**LIMITS, "memory_mb": self.memory_mb}

    def shell(self, command: str, extra: dict[str, dict]) -> str:
        """A call of its shell tool running ``command``, with the arguments ``extra`` adds for it."""
        key = "cmd" if self.tool == "exec_command" else "command"  # Codex: cmd
        return shell_call(self.tool, {key: command, **extra.get(self.tool, {})})

    @property
    def replies(self) -> tuple[str, ...]:
        """The episode the model learns: a shell call that computes, then the answer."""
        return (self.shell("echo $((12+30))", SHELL_EXTRA), "42")

    @property
    def swe_replies(self) -> tuple[str, ...]:
        """On the shipped SWE instance: a shell call that edits the checkout, then its last word."""
        return (self.shell(SWE_FIX, SWE_SHELL_EXTRA), "Fixed.")

    @property
    def lean(self) -> str:
        return f"{self.preset}-lean"


SHELL_EXTRA = {"bash": {"description": "Compute 12 + 30"}}  # OpenCode's bash tool requires a description
SWE_SHELL_EXTRA = {"bash": {"description": "Fix the stock check"}}

QWEN_CODE = Cli("qwen-code", "run_shell_command", 2,
                ("--bare", f"--system-prompt={SYSTEM}", "--core-tools=run_shell_command",
                 "--exclude-tools=edit,get_goal,notebook_edit,read_file,update_goal"),
                lean_files=(FIXED_DATE_FILE,), lean_env=(("NODE_OPTIONS", "--require={harness_dir}/fixed-date.js"),),
                # Its shell tool's description alone is ~2.5k tokens, and it echoes the command in the result.
                swe_context_tokens=8192)
# Its prompt and tools come from its config: the build agent's prompt, and every tool but bash off;
# the fixed date, a plugin of its config. Before it loads a plugin, OpenCode installs its plugin SDK
# (npm @opencode-ai/plugin) into its config folder unless that folder's lock lists it: in a sandbox
# without network, ~70 s of retries, then a failure. The plugin imports nothing of it, and the lock
# and the package's manifest say it is there.
_OPENCODE_CONFIG_DIR = "{harness_dir}/home/.config/opencode"
OPENCODE = Cli("opencode", "bash", 1, (),
               json.dumps({"agent": {"build": {"prompt": SYSTEM}},
                           "tools": {name: False for name in ("edit", "glob", "grep", "read", "skill", "task",
                                                              "todowrite", "webfetch", "write")},
                           "plugin": ["file://{harness_dir}/fixed-date-plugin.js"]}),
               memory_mb=16384,
               lean_files=(FIXED_DATE_FILE,
                           ("{harness_dir}/fixed-date-plugin.js",
                            'import "./fixed-date.js";\nexport const FixedDate = async () => ({});\n'),
                           (f"{_OPENCODE_CONFIG_DIR}/package-lock.json",
                            json.dumps({"packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}})),
                           (f"{_OPENCODE_CONFIG_DIR}/node_modules/@opencode-ai/plugin/package.json",
                            json.dumps({"name": "@opencode-ai/plugin"}))))

# Its instructions from a file of its own; its sub-agents, goals and skills off, and no date (nor
# zone) in its <environment_context> (its own config keys).
CODEX = Cli("codex", "exec_command", 2,
            ("-c", 'model_instructions_file="{harness_dir}/instructions.md"', "-c", "features.multi_agent=false",
             "-c", "features.goals=false", "-c", "features.skills=false",
             "-c", "include_environment_context_time=false"),
            lean_files=(("{harness_dir}/instructions.md", SYSTEM),))

CLAUDE_CODE = Cli("claude-code", "Bash", 1, (f"--system-prompt={SYSTEM}", "--tools=Bash"), memory_mb=16384,
                  lean_files=(FIXED_DATE_FILE,), lean_env=(("BUN_OPTIONS", "--preload={harness_dir}/fixed-date.js"),))

CLIS = {cli.preset: cli for cli in (QWEN_CODE, OPENCODE, CODEX, CLAUDE_CODE)}


def _toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings: JSON's escapes are TOML's


def lean_preset_text(cli: Cli) -> str:
    """The shipped preset's file with the lean options added to its command line, under its own name."""
    data = tomllib.loads(find_preset(cli.preset).source.read_text())
    data["name"] = cli.lean
    argv = data["run"]["argv"]
    at = next(i for i, a in enumerate(argv) if "{instruction}" in a)
    data["run"]["argv"] = argv[:at] + list(cli.lean_args) + argv[at:]
    data["files"] = data.get("files", []) + [{"path": path, "content": content} for path, content in cli.lean_files]
    env = data["run"].setdefault("env", {})
    for name, value in cli.lean_env:
        env[name] = f"{env[name]} {value}" if name in env else value
    if cli.lean_config:
        config = json.loads(data["files"][0]["content"])
        config.update(json.loads(cli.lean_config))
        data["files"][0]["content"] = json.dumps(config)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if isinstance(v, dict)]
    lines += [f"files = {_toml_value(data['files'])}"] if data.get("files") else []
    return "\n".join(lines) + "\n"


def write_lean_presets(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for cli in CLIS.values():
        (folder / f"{cli.lean}.toml").write_text(lean_preset_text(cli))
    return folder


def episode_of(which: str) -> tuple[Cli, str]:
    """The CLI and the episode ('arith', 'swe') a model is named by: 'codex', 'codex-swe'."""
    preset = which.removesuffix("-swe")
    return CLIS[preset], "arith" if preset == which else "swe"


def date_forms(day: datetime.date) -> tuple[str, ...]:
    """The ways the CLIs write a day: ISO (Claude Code, Codex), Date.toDateString() (OpenCode),
    toLocaleDateString en-US long (Qwen Code)."""
    return day.isoformat(), day.strftime("%a %b %d %Y"), f"{day:%A, %B} {day.day}, {day.year}"


def real_date_shown(text: str) -> str | None:
    """The real date (the day before to the day after today here: whatever the sandbox's zone), as
    a CLI writes it, where ``text`` shows it."""
    today = datetime.date.today()
    for day in (today - datetime.timedelta(days=1), today, today + datetime.timedelta(days=1)):
        for form in date_forms(day):
            if form in text:
                return form
    return None


def _swe_setup():
    """The shipped SWE instance's sandbox spec, instruction, and its init (the checkout), as a job's."""
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.messages import Envelope, Job
    from rollstream.tasks.swe import SweTask

    from .sandbox_presets import swe_instance

    instance = swe_instance()

    async def checkout(handle, sandbox) -> None:
        await SweTask().prepare(Envelope(job=Job(task="swe", instance=instance), sandbox=handle), sandbox)

    return SweTask().sandbox_spec(instance), instruction_of(SweTask().prompt_messages(instance)), checkout


def model_key(cli: Cli, episode: str = "arith") -> str:
    """Changes with the preset, the episode and the way the model is built (not with the day: the
    lean variants show the CLIs a fixed one, and episode_examples checks that they do)."""
    replies = cli.replies if episode == "arith" else (cli.swe_replies, _swe_setup()[1])
    parts = [lean_preset_text(cli), json.dumps(replies), str(RECIPE),
             Path(__file__).with_name("door_capture.py").read_text()]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def trained_folder(parent: Path, which: str) -> Path:
    """Where the model of episode ``which`` ('codex': arith, 'codex-swe') is kept (tests/model_cache.py)."""
    cli, episode = episode_of(which)
    return parent / f"{which}-{model_key(cli, episode)}"


def build(parent: Path, which: str, steps: int = 300) -> Path:
    """Install the CLI (once), capture its episode through a scripted door, and train the tiny
    model on the door's own renderings of its calls (each call's prompt, then its reply)."""
    from .episode_model import train_episode

    return train_episode(trained_folder(parent, which), parent / "base",
                         lambda tokenizer: episode_examples(tokenizer, which), steps)


def episode_examples(tokenizer, which: str) -> list[tuple[list[int], list[int]]]:
    """The CLI's episode (``which``: 'codex' its arith one, 'codex-swe' its SWE one) captured in a
    bwrap sandbox of the task, set up as the task's init sets it up (installing the CLI once): each
    call's prompt ids as the door rendered them, then the scripted reply (mask 1)."""
    from rollstream.agent.presets import load_preset
    from rollstream.agent.sandbox_harness import instruction_of
    from rollstream.tasks.arith import ArithTask

    from .door_capture import capture_in_sandbox

    cli, episode = episode_of(which)
    install_on_host(find_preset(cli.preset))
    if episode == "arith":
        spec, instruction, prepare = (ArithTask().sandbox_spec(INSTANCE),
                                      instruction_of(ArithTask().prompt_messages(INSTANCE)), None)
        replies = cli.replies
    else:
        (spec, instruction, prepare), replies = _swe_setup(), cli.swe_replies
    spec = spec.model_copy(update={"limits": spec.limits.model_copy(update=cli.limits)})
    with tempfile.TemporaryDirectory(prefix="rs-capture-") as scratch:
        lean = load_preset(write_lean_presets(Path(scratch)) / f"{cli.lean}.toml")
        captured = capture_in_sandbox(tokenizer, list(replies), lean, instruction, spec, prepare=prepare)
    if len(captured.prompts) != len(replies) or captured.exit_code != 0:
        raise RuntimeError(f"{which} made {len(captured.prompts)} calls (the episode has {len(replies)}) "
                           f"and exited {captured.exit_code}:\n{captured.output[-3000:]}")
    for prompt in captured.prompts:
        if shown := real_date_shown(tokenizer.decode(prompt)):
            raise RuntimeError(f"{which} showed the model today's date ({shown!r}): a model learnt on it "
                               f"fails on another day; its lean variant must show it FIXED_DAY")
    return [(prompt + reply, [0] * len(prompt) + [1] * len(reply))
            for prompt, reply in zip(captured.prompts, captured.replies)]


async def run_job(settings, server: str, job: dict):
    """Submit ``job`` with ``server`` as the backend; its result."""
    [result] = await run_jobs(settings, server, [job])
    return result


async def run_jobs(settings, server: str, jobs: list[dict], timeout_s: float = 600):
    """Submit ``jobs`` at once with ``server`` as the backend (the namespace's only one: a module's
    tests may share a namespace and pool, each test its server); their results, in the jobs' order."""
    from rollstream.client import AsyncClient
    from rollstream.llm.balancer import add_backend, list_backends, remove_backend

    async with AsyncClient(settings=settings) as client:
        for backend in await list_backends(client.r, settings.namespace):
            await remove_backend(client.r, backend.url, settings.namespace)
        await add_backend(client.r, server, settings.namespace)
        ids = [str(await client.submit(job)) for job in jobs]
        results = {result.job_id: result for result in await client.collect(len(jobs), timeout_s=timeout_s)}
    return [results[job_id] for job_id in ids]


def assert_answered_and_scored(result, tool: str, calls: int) -> None:
    """The CLI made the episode's calls (a ``tool`` call, then the answer), exited 0, and its
    answer was scored right."""
    assert result.status == "completed", result.error
    traj = result.trajectory
    run = traj.extra["harness_run"]
    assert traj.finish_reason == "stop" and run["exit_code"] == 0, run
    assert len(traj.extra["calls"]) == calls and traj.extra["door"] == {"requests": calls, "refused": 0}, traj.extra
    assert f'"name": "{tool}"' in traj.response_text, traj.response_text
    assert traj.extra["answer"] == "42" and result.reward == 1.0, (run, traj.response_text[-1500:])
