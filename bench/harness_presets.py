"""Harness presets inside sandboxes (issue 29): how long a shipped preset takes to start inside a
warm bubblewrap sandbox, and whether 64 in-sandbox harness jobs at once through the whole pipeline
lose a model call.

    python bench/harness_presets.py [--starts 5] [--jobs 64] [--calls 3] [--presets mini-swe-agent,openhands-sdk]

1. Start: one warm sandbox; each preset (installed: scripts/install-harnesses) is launched as the
   run stage launches it (agent/sandbox_harness.py: its files, the relay, the job's door socket),
   against a door whose model answers at once with the preset's own way to stop; the start time
   is from the launch to its first model call reaching the door (relay, interpreter, imports, the
   agent's own setup), ``--starts`` times each; p50 per preset.
2. Concurrency: real workers (run stage concurrency = ``--jobs``), the built-in server with the
   tiny arith model, ``--jobs`` arith jobs at once whose harness is a preset (a stdlib OpenAI
   client in the sandbox) making ``--calls`` calls and printing how many were answered; a lost
   call is one the harness made and got answered that the job's trajectory lacks, or a job
   without a result.

Prints a table, then ``RESULT {json}`` with ``preset_start_p50_s`` (the slowest preset's p50),
``preset_start_p50_s_by_preset``, ``concurrent_jobs_lost_calls``, ``concurrent_jobs`` and
``concurrent_wall_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.agent.gateway import Gateway
from rollstream.agent.presets import find_preset
from rollstream.agent.sandbox_harness import HARNESS_SESSION, launch_values, stage_launch
from rollstream.client import AsyncClient
from rollstream.config import Settings
from rollstream.episode_settings import agent_settings
from rollstream.llm.balancer import add_backend
from rollstream.llm.inference_client import Generation
from rollstream.pipeline.embedded import EmbeddedRedis
from rollstream.sampling import SamplingParams
from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.tasks import arith
from rollstream.workers.pool import WorkerPool

# What each shipped preset's model says to end at once (its first call is what is timed).
STOP_REPLIES = {
    "mini-swe-agent": "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    "openhands-sdk": '<tool_call>\n{"name": "finish", "arguments": {"message": "done"}}\n</tool_call>',
}

# The concurrency run's harness: N calls through the relay, as any OpenAI client makes them.
CALLER = r'''
import json, os, sys, urllib.request
answered = 0
for i in range(int(sys.argv[2])):
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "messages": [{"role": "user", "content": f"{sys.argv[1]} ({i})"}],
                         "max_tokens": 8}).encode(),
        headers={"authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        answered += response.status == 200 and bool(json.load(response)["choices"])
print("ANSWERED", answered)
'''


def caller_preset(calls: int) -> str:
    files = f'[[files]]\npath = "{{harness_dir}}/caller.py"\ncontent = {json.dumps(CALLER)}\n'
    return ('name = "bench-caller"\napi = "openai-chat"\n\n[run]\n'
            f'argv = ["python3", "{{harness_dir}}/caller.py", "{{instruction}}", "{calls}"]\n\n[run.env]\n'
            'OPENAI_BASE_URL = "{door_url}"\nOPENAI_API_KEY = "{door_key}"\n\n' + files)


class FirstCall:
    """The door's LLM session for the start run: notes when the first call arrives, answers the
    preset's stop reply."""

    backend = "bench"

    def __init__(self, tokenizer, reply: str) -> None:
        self.ids = tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
        self.first_at: float | None = None

    async def generate(self, prompt_ids: list[int], params, on_tokens=None) -> Generation:
        if self.first_at is None:
            self.first_at = time.monotonic()
        if on_tokens is not None:  # a streaming call: the reply in one piece
            await on_tokens(list(self.ids), [0.0] * len(self.ids))
        return Generation(token_ids=list(self.ids), logprobs=[0.0] * len(self.ids), finish_reason="stop")

    async def close(self) -> None:
        pass


async def preset_starts(names: list[str], starts: int, tokenizer, root: str) -> dict[str, list[float]]:
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"bench{uuid.uuid4().hex[:6]}",
                                  owner="bench", root_dir=root)
    gateway = await Gateway().start()
    settings = agent_settings({"max_turns": 8, "max_context_tokens": 1 << 20, "max_tokens_per_turn": 4096},
                              SamplingParams(temperature=0.0))
    found: dict[str, list[float]] = {}
    try:
        async with SandboxClient(handle.socket_path) as sandbox:
            await sandbox.bash("true", timeout_s=120)  # warm: the shell is up
            for name in names:
                preset = find_preset(name)
                if preset is None or not preset.installed_on_host():
                    raise SystemExit(f"{name} is not installed here: scripts/install-harnesses {name}")
                found[name] = []
                for _ in range(starts):
                    session = FirstCall(tokenizer, STOP_REPLIES[name])
                    door = gateway.open("bench", session, tokenizer, settings)
                    await gateway.open_in_sandbox(door, os.path.join(os.path.dirname(sandbox.socket_path), "door"))
                    command = await stage_launch(sandbox, preset, door.key, launch_values(preset, "Say done."))
                    started = time.monotonic()
                    result = await sandbox.bash(command, timeout_s=600, no_output_timeout_s=0,
                                                session=HARNESS_SESSION)
                    gateway.close(door)
                    await sandbox.close_session(HARNESS_SESSION)
                    if session.first_at is None:
                        raise SystemExit(f"{name} made no call (exit {result.exit_code}):\n{result.output[-2000:]}")
                    found[name].append(session.first_at - started)
    finally:
        await gateway.aclose()
        await destroy_sandbox(handle)
    return found


async def concurrent_jobs(settings: Settings, server: str, jobs: int, calls: int) -> tuple[int, int, float, int]:
    """(lost calls, calls answered, wall seconds, jobs completed). Each harness makes ``calls``
    calls: a call is lost when it was not answered, or answered but missing from the trajectory;
    a job without a result loses all of its calls."""
    async with AsyncClient(settings=settings) as client:
        await add_backend(client.r, server, settings.namespace)
        started = time.monotonic()
        for i in range(jobs):
            await client.submit(arith.job({"a": i, "op": "+", "b": 1},
                                          agent={"harness": "bench-caller", "max_turns": calls + 1,
                                                 "max_tokens_per_turn": 8, "max_wall_time_s": 900}))
        results = await client.collect(jobs, timeout_s=1800)
        wall = time.monotonic() - started
    lost, answered, completed = jobs - len(results), 0, 0
    for result in results:
        traj = result.trajectory
        if result.status != "completed" or traj is None:
            lost += calls
            continue
        completed += 1
        got = int(next((line.split()[1] for line in traj.extra["harness_run"]["output_tail"].splitlines()
                        if line.startswith("ANSWERED")), "0"))
        answered += got
        # Answered in the sandbox but not in the trajectory; or never answered (refused, cut).
        lost += max(0, got - len(traj.extra["calls"])) + (calls - got)
    return lost, answered, wall, completed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--presets", default="mini-swe-agent,openhands-sdk")
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from rollstream.demo.arith_model import FORMAT_RECIPE, cached_arith_model
    from rollstream.llm.server import served_model

    model = cached_arith_model(FORMAT_RECIPE)
    tokenizer = AutoTokenizer.from_pretrained(model)
    root = tempfile.mkdtemp(prefix="rs-bench-", dir="/tmp")
    os.chmod(root, 0o711)
    out: dict = {}
    rows = []
    names = [n for n in args.presets.split(",") if n]
    starts = asyncio.run(preset_starts(names, args.starts, tokenizer, root))
    out["preset_start_p50_s_by_preset"] = {n: round(statistics.median(v), 3) for n, v in starts.items()}
    out["preset_start_p50_s"] = max(out["preset_start_p50_s_by_preset"].values())
    for name, values in starts.items():
        rows.append((f"start of {name} in a warm bwrap sandbox", f"p50 {statistics.median(values):.2f} s",
                     f"min {min(values):.2f} max {max(values):.2f} s", f"{len(values)} starts"))
    tmp = Path(tempfile.mkdtemp(prefix="rs-bench-"))
    presets = tmp / "presets"
    presets.mkdir()
    (presets / "bench-caller.toml").write_text(caller_preset(args.calls))
    with EmbeddedRedis(tmp / "redis") as redis_server, served_model(model, device="cpu") as server:
        namespace = f"b{uuid.uuid4().hex[:6]}"
        pool = WorkerPool(redis_url=redis_server.url, namespace=namespace, node="bench", data_dir=tmp / "data",
                          env={"ROLLSTREAM_HARNESS_PRESET_DIRS": json.dumps([str(presets)]),
                               "ROLLSTREAM_SANDBOX_ROOT": root, "ROLLSTREAM_MODEL_DIR": str(model)},
                          log_dir=tmp / "logs")
        pool.start_all(concurrency=args.jobs)
        try:
            settings = Settings(redis_url=redis_server.url, namespace=namespace, data_dir=tmp / "data", node="bench")
            lost, answered, wall, completed = asyncio.run(concurrent_jobs(settings, server, args.jobs, args.calls))
        finally:
            pool.stop()
    out.update(concurrent_jobs=args.jobs, concurrent_jobs_completed=completed, concurrent_calls_answered=answered,
               concurrent_jobs_lost_calls=lost, concurrent_wall_s=round(wall, 1))
    rows.append((f"{args.jobs} in-sandbox harness jobs at once", f"{lost} calls lost",
                 f"{answered} of {args.jobs * args.calls} answered", f"{completed} completed in {wall:.0f} s"))
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    table = [("measure", "value", "spread", "note"), *rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    print("\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table))
    print(f"(load average {out['load_avg_1m']} on {os.cpu_count()} cores: starts compare within one run only)")
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
