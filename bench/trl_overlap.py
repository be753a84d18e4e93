"""Wall time per TRL GRPO step: rollouts through rollstream versus TRL generating in-process,
same model, same batch, same tool time, swept over tool time and rollouts per step, to show
where the door wins and where it does not.

Both sides train the warmed-up arith model with TRL 1.16's GRPOTrainer on the CPU, PROMPTS x
G rollouts per step, two model turns per rollout (a bash call, then submit), and every bash
call costs a fixed tool time on top of running the command:

- rollstream: ``rollout_func=RolloutFunc(...)`` + ``WeightSyncCallback`` (weights published
  to the built-in server after every step). Init/run/eval worker processes (started by this
  program, with a run stage whose bash tool first sleeps the tool time), bubblewrap sandboxes.
  Tools of different rollouts run at once.
- in-process: TRL's default generation (``model.generate`` in the trainer) with TRL's own
  tool loop (``tools=[bash, submit]``, ``max_tool_calling_iterations=1``): the ``bash``
  function sleeps the tool time and runs the command with ``bash -c``, one call after another.
  Its tokenizer renders the same tool block rollstream's agent shows the model, so both see
  identical prompts.

One trainer run per side and rollouts-per-step setting; within a run the tool time steps
through --tool-ms, STEPS steps each, after WARMUP steps. Step time = time between consecutive
``on_step_end`` events (generation, tools, loss, optimizer step and, on the rollstream side,
the weight sync). The defaults are an agent workload: tools of 50 ms to 2 s (a SWE test run
takes seconds) and 8 or 32 rollouts a step; 8 to 10 minutes on a busy 2-core machine.

    python bench/trl_overlap.py [--tool-ms 50,500,2000] [--prompts 2,8] [--group 4] [--steps 2]

Prints s/step of each side per point, the ratio, and where the ratio crosses 1 (the crossover);
last line: RESULT {"points": [...], "crossover_tool_ms": {...}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TOOL_MS_FILE_ENV = "ROLLSTREAM_BENCH_TOOL_MS_FILE"  # the file holding the current tool time, in ms


# -- the worker side: `python bench/trl_overlap.py --worker STAGE` ----------------------------
def serve_worker(stage: str, concurrency: int) -> None:
    """A normal rollstream worker whose sandbox tools (not the finish tool) take the tool time
    more; the trainer side changes that time between steps (the file it names)."""
    import rollstream.agent.tools as agent_tools
    from rollstream.config import load_settings
    from rollstream.workers.process import run_worker

    tool_ms_file = Path(os.environ[TOOL_MS_FILE_ENV])

    class SlowToolAdapter(agent_tools.CallToolAdapter):
        async def call(self, name: str, arguments: dict):
            await asyncio.sleep(float(tool_ms_file.read_text()) / 1000)
            return await super().call(name, arguments)

    # AgentTask.rollout imports the adapter when it runs, so this reaches every tool call
    agent_tools.CallToolAdapter = SlowToolAdapter
    run_worker(stage, load_settings(), concurrency)


# -- the trainer side --------------------------------------------------------------------------
def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall-clock marks at training start and at each step's end (after other callbacks)."""

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

        def step_s(self) -> list[float]:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]

    return StepTimer()


def write_tool_ms(path: Path, ms: float) -> None:
    """Replace the file in one step: workers read it at every tool call."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(ms))
    os.replace(tmp, path)


def tool_time_schedule(plan: list[float], set_tool_ms):
    """Sets the tool time of each step: plan[k] for step k (0-based), before its rollouts."""
    from transformers import TrainerCallback

    class ToolTimeSchedule(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            set_tool_ms(plan[0])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step < len(plan):
                set_tool_ms(plan[state.global_step])

    return ToolTimeSchedule()


def step_plan(args) -> list[float]:
    """The tool time of every step of a run: warm-up steps at the first, then STEPS at each."""
    return [args.tool_ms[0]] * args.warmup + [t for t in args.tool_ms for _ in range(args.steps)]


def per_tool_ms(args, step_s: list[float]) -> dict[float, float]:
    """Mean step time at each tool time, warm-up steps left out."""
    plan = step_plan(args)
    return {t: statistics.fmean(s for s, p in list(zip(step_s, plan))[args.warmup:] if p == t) for t in args.tool_ms}


def grpo_config(args, prompts: int, out_dir: Path, **extra):
    import trl

    return trl.GRPOConfig(
        output_dir=str(out_dir), max_steps=len(step_plan(args)), per_device_train_batch_size=prompts * args.group,
        num_generations=args.group, learning_rate=1e-5, temperature=1.0, beta=0.0, bf16=False, use_cpu=True,
        gradient_checkpointing=False, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **extra)


def quiet(trainer) -> None:
    """No dict of metrics printed per step: the table at the end is the output."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def load_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def run_rollstream(args, prompts: int, model_dir: Path, redis_url: str, work: Path, instances: list[dict]) -> dict:
    import trl
    from datasets import Dataset

    from rollstream.config import Settings
    from rollstream.integrations.trl import RolloutFunc, rollstream_reward
    from rollstream.integrations.trl_weight_sync import WeightSyncCallback
    from rollstream.llm.balancer import add_backend
    from rollstream.llm.server.app import start_server_process
    from rollstream.workers.pool import WorkerPool

    namespace = f"trl{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True, exist_ok=True)
    tool_ms_file = work / "tool_ms"
    write_tool_ms(tool_ms_file, args.tool_ms[0])
    settings = Settings(redis_url=redis_url, namespace=namespace, data_dir=work / "data", node="bench")
    pool = WorkerPool(redis_url=redis_url, namespace=namespace, node="bench", data_dir=work / "data",
                      env={"ROLLSTREAM_MODEL_DIR": str(model_dir), "OMP_NUM_THREADS": "1",
                           "ROLLSTREAM_READ_BLOCK_MS": "100", TOOL_MS_FILE_ENV: str(tool_ms_file)},
                      log_dir=work / "logs", program=[sys.executable, __file__, "--worker"])
    server, url = start_server_process(model_dir, device="cpu")
    pool.start_all(concurrency=max(16, 2 * prompts * args.group))
    rollout = RolloutFunc("arith", settings=settings, instances=instances,
                          sampling={"temperature": 1.0, "max_tokens": args.max_tokens},
                          agent={"max_turns": 2, "max_tokens_per_turn": args.max_tokens, "max_context_tokens": 1024},
                          batch_timeout_s=600)
    try:
        rollout.connection.run(add_backend(rollout.connection.client.r, url, namespace))
        model, tokenizer = load_model(model_dir)
        timer = step_timer()
        trainer = trl.GRPOTrainer(
            model=model, processing_class=tokenizer, reward_funcs=[rollstream_reward],
            args=grpo_config(args, prompts, work / "trl-rollstream"),
            train_dataset=Dataset.from_list(rollout.dataset_rows(instances)), rollout_func=rollout,
            callbacks=[sync := WeightSyncCallback(work / "weights", rollout_func=rollout),
                       tool_time_schedule(step_plan(args), lambda ms: write_tool_ms(tool_ms_file, ms)), timer])
        quiet(trainer)
        trainer.train()
        reports = list(rollout.reports)[args.warmup:]
        return {"step_s": per_tool_ms(args, timer.step_s()),
                "wait_s": statistics.fmean(r.wait_s for r in reports),
                "failed": sum(r.failed for r in rollout.reports),
                "sync_s": statistics.fmean(r.total_s for r in sync.reports[1 + args.warmup:]),
                "versions": [sorted(set(r.policy_versions)) for r in rollout.reports]}
    finally:
        rollout.close()
        pool.stop()
        server.terminate()
        server.wait(30)


def same_tool_block(tokenizer) -> None:
    """Render the tool block exactly as rollstream's agent does (its schemas, not the ones
    transformers derives from the Python functions' docstrings): same prompt tokens."""
    from trl.chat_template_utils import qwen3_template

    from rollstream.agent.tools import submit_tool_schema
    from rollstream.tasks import arith

    block = "".join("\n" + json.dumps(s) for s in (arith.BASH_SCHEMA, submit_tool_schema("submit")))
    loop = "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    if loop not in tokenizer.chat_template:
        raise SystemExit("the arith model's chat template changed: update same_tool_block")
    tokenizer.chat_template = tokenizer.chat_template.replace(loop, "{{- " + json.dumps(block) + " -}}")
    tokenizer.response_template = qwen3_template  # Hermes <tool_call> parsing, as for Qwen


def run_inprocess(args, prompts: int, model_dir: Path, work: Path, instances: list[dict]) -> dict:
    import trl
    from datasets import Dataset

    from rollstream.tasks import arith

    delay_s = [args.tool_ms[0] / 1000]
    tool_calls = [0]

    def bash(command: str) -> str:
        """Run a shell command.

        Args:
            command: The command to run.

        Returns:
            What the command printed.
        """
        tool_calls[0] += 1
        time.sleep(delay_s[0])
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=10)
        return done.stdout + done.stderr

    def submit(answer: str) -> str:
        """Submit the final answer and end the task.

        Args:
            answer: final answer

        Returns:
            An acknowledgement.
        """
        return "submitted"

    model, tokenizer = load_model(model_dir)
    same_tool_block(tokenizer)
    timer = step_timer()
    # per-turn token cap as rollstream's max_tokens; the whole completion may hold both turns
    config = grpo_config(args, prompts, work / "trl-inprocess", max_tool_calling_iterations=1,
                         max_completion_length=4 * args.max_tokens,
                         generation_kwargs={"max_new_tokens": args.max_tokens})
    trainer = trl.GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[zero_reward], args=config,
        train_dataset=Dataset.from_list([{"prompt": arith.prompt(inst)} for inst in instances]),
        tools=[bash, submit],
        callbacks=[tool_time_schedule(step_plan(args), lambda ms: delay_s.__setitem__(0, ms / 1000)), timer])
    quiet(trainer)
    trainer.train()
    frequency = [row["tools/call_frequency"] for row in trainer.state.log_history if "tools/call_frequency" in row]
    return {"step_s": per_tool_ms(args, timer.step_s()), "tool_calls": tool_calls[0],
            "call_frequency": statistics.mean(frequency) if frequency else 0.0}


def crossover_ms(points: list[dict]) -> float | None | str:
    """The tool time where in-process/rollstream crosses 1 (linear between measured points):
    a number, "never" (in-process faster at every point) or "always" (rollstream faster)."""
    for a, b in zip(points, points[1:]):
        if (a["speedup"] - 1) * (b["speedup"] - 1) <= 0 and a["speedup"] != b["speedup"]:
            slope = (b["tool_ms"] - a["tool_ms"]) / (b["speedup"] - a["speedup"])
            return round(a["tool_ms"] + (1 - a["speedup"]) * slope)
    if all(p["speedup"] > 1 for p in points):
        return "always"
    return "never"


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool-ms", type=numbers, default=[50.0, 500.0, 2000.0],
                    help="tool times to sweep, comma-separated (ms each bash call takes)")
    ap.add_argument("--prompts", type=lambda t: numbers(t, int), default=[2, 8],
                    help="distinct prompts per step to sweep, comma-separated (rollouts = prompts x group)")
    ap.add_argument("--group", type=int, default=4, help="rollouts per prompt (num_generations)")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per tool time")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the trainer process, both sides (two spin-waiting threads on a busy "
                         "2-core machine made in-process generation several times slower)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve_worker(args.worker, args.concurrency)
        return

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, once per step

    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    from rollstream.demo.arith_model import FORMAT_RECIPE, cached_arith_model
    from rollstream.pipeline.embedded import EmbeddedRedis
    from rollstream.tasks import arith

    hf_logging.disable_progress_bar()
    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.monotonic()
    cache = Path(os.environ.get("ROLLSTREAM_TEST_CACHE") or Path.home() / ".cache" / "rollstream" / "tests")
    model_dir = cached_arith_model(FORMAT_RECIPE, cache=cache, prefix="arith-model")  # the tests' model
    work = Path(tempfile.mkdtemp(prefix="rs-trl-overlap-"))
    points, notes = [], {}
    for prompts in args.prompts:
        instances = arith.make_instances(prompts * len(step_plan(args)), seed=5)
        with EmbeddedRedis(work / f"redis-{prompts}", appendonly=False) as redis_server:
            door = run_rollstream(args, prompts, model_dir, redis_server.url, work / f"rs-{prompts}", instances)
        inproc = run_inprocess(args, prompts, model_dir, work / f"inproc-{prompts}", instances)
        notes[prompts * args.group] = {"rollout_wait_s": round(door["wait_s"], 3),
                                       "weight_sync_s": round(door["sync_s"], 3),
                                       "failed_rollouts": door["failed"], "policy_versions_per_step": door["versions"],
                                       "bash_calls_per_rollout_inprocess": round(inproc["call_frequency"], 2)}
        for t in args.tool_ms:
            rs_s, ip_s = door["step_s"][t], inproc["step_s"][t]
            points.append({"rollouts": prompts * args.group, "tool_ms": t, "step_s_rollstream": round(rs_s, 3),
                           "step_s_inprocess": round(ip_s, 3), "speedup": round(ip_s / rs_s, 3)})

    print(f"TRL GRPO, arith model on CPU, 2 model turns per rollout (bash, then submit), {args.steps} steps per "
          f"point after {args.warmup} warm-up, {args.threads} trainer thread(s); "
          f"load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print(f"{'rollouts/step':>13} {'tool ms':>8} {'rollstream s/step':>18} {'in-process s/step':>18} "
          f"{'in-process/rollstream':>22}")
    for p in points:
        verdict = "rollstream faster" if p["speedup"] > 1 else "in-process faster"
        print(f"{p['rollouts']:>13} {p['tool_ms']:>8.0f} {p['step_s_rollstream']:>18.2f} "
              f"{p['step_s_inprocess']:>18.2f} "
              f"{p['speedup']:>21.2f}x  {verdict}")
    crossovers = {}
    for rollouts, note in notes.items():
        mine = [p for p in points if p["rollouts"] == rollouts]
        crossovers[rollouts] = cross = crossover_ms(mine)
        if cross == "always":
            where = "rollstream is faster at every tool time measured"
        elif cross == "never":
            where = "in-process TRL is faster at every tool time measured"
        elif mine[0]["speedup"] < 1:
            where = f"in-process TRL is faster below ~{cross} ms per tool call, rollstream from there up"
        else:
            where = f"rollstream is faster below ~{cross} ms per tool call, in-process TRL above"
        print(f"{rollouts} rollouts/step: {where} "
              f"(rollstream: rollout wait {note['rollout_wait_s']:.2f} s/step, weight "
              f"sync {note['weight_sync_s']:.2f} s/step, {note['failed_rollouts']} failed; in-process: "
              f"{note['bash_calls_per_rollout_inprocess']:.2f} bash calls/rollout, run one after another)")
    print("RESULT " + json.dumps({
        "points": points, "crossover_tool_ms": crossovers, "notes": notes, "group": args.group,
        "steps_per_point": args.steps, "threads": args.threads, "seconds": round(time.monotonic() - started, 1),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()]}))


if __name__ == "__main__":
    main()
