"""Wall time per TRL GRPO step: rollouts through rollstream versus TRL generating in-process,
same model, same batch, same tool time.

Both sides train the warmed-up arith model with TRL 1.16's GRPOTrainer on the CPU, PROMPTS x
G rollouts per step, two model turns per rollout (a bash call, then submit), and every bash
call costs a fixed TOOL_MS on top of running the command:

- rollstream: ``rollout_func=RolloutFunc(...)`` + ``WeightSyncCallback`` (weights published
  to the built-in server after every step). Init/run/eval worker processes (started by this
  program, with a run stage whose bash tool first sleeps TOOL_MS), bubblewrap sandboxes.
- in-process: TRL's default generation (``model.generate`` in the trainer) with TRL's own
  tool loop (``tools=[bash, submit]``, ``max_tool_calling_iterations=1``): the ``bash``
  function sleeps TOOL_MS and runs the command with ``bash -c``. Its tokenizer renders the
  same tool block rollstream's agent shows the model, so both see identical prompts.

Step time = time between consecutive ``on_step_end`` events (generation, tools, loss,
optimizer step and, on the rollstream side, the weight sync), after WARMUP steps.

    python bench/trl_overlap.py [--steps 4] [--warmup 1] [--prompts 4] [--group 4] [--tool-ms 50]

Last line: RESULT {"step_s_rollstream", "step_s_inprocess", "speedup", ...}.
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

TOOL_MS_ENV = "ROLLSTREAM_BENCH_TOOL_MS"


# -- the worker side: `python bench/trl_overlap.py --worker STAGE` ----------------------------
def serve_worker(stage: str, concurrency: int) -> None:
    """A normal rollstream worker whose sandbox tools (not the finish tool) take TOOL_MS more."""
    import rollstream.agent.tools as agent_tools
    from rollstream.config import load_settings
    from rollstream.workers.process import run_worker

    delay_s = float(os.environ.get(TOOL_MS_ENV, "50")) / 1000

    class SlowToolAdapter(agent_tools.CallToolAdapter):
        async def call(self, name: str, arguments: dict):
            await asyncio.sleep(delay_s)
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

        def step_s(self, warmup: int) -> list[float]:
            return [b - a for a, b in zip(self.marks, self.marks[1:])][warmup:]

    return StepTimer()


def grpo_config(args, out_dir: Path, **extra):
    import trl

    return trl.GRPOConfig(
        output_dir=str(out_dir), max_steps=args.steps + args.warmup, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, learning_rate=1e-5, temperature=1.0, beta=0.0, bf16=False, use_cpu=True,
        gradient_checkpointing=False, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **extra)


def load_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(model_dir)


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def run_rollstream(args, model_dir: Path, redis_url: str, work: Path, instances: list[dict]) -> dict:
    import trl
    from datasets import Dataset

    from rollstream.config import Settings
    from rollstream.integrations.trl import RolloutFunc, rollstream_reward
    from rollstream.integrations.trl_weight_sync import WeightSyncCallback
    from rollstream.llm.server.app import start_server_process
    from rollstream.pipeline.balancer import add_backend
    from rollstream.workers.pool import WorkerPool

    namespace = f"trl{uuid.uuid4().hex[:6]}"
    settings = Settings(redis_url=redis_url, namespace=namespace, data_dir=work / "data", node="bench")
    pool = WorkerPool(redis_url=redis_url, namespace=namespace, node="bench", data_dir=work / "data",
                      env={"ROLLSTREAM_MODEL_DIR": str(model_dir), "ROLLSTREAM_SANDBOX_ROOT": str(work / "sb"),
                           "ROLLSTREAM_READ_BLOCK_MS": "100", TOOL_MS_ENV: str(args.tool_ms)},
                      log_dir=work / "logs", program=[sys.executable, __file__, "--worker"])
    server, url = start_server_process(model_dir, device="cpu")
    pool.start_all(concurrency=max(16, 2 * args.prompts * args.group))
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
            args=grpo_config(args, work / "trl-rollstream"),
            train_dataset=Dataset.from_list(rollout.dataset_rows(instances)), rollout_func=rollout,
            callbacks=[sync := WeightSyncCallback(work / "weights", rollout_func=rollout), timer])
        trainer.train()
        reports = list(rollout.reports)[args.warmup:]
        return {"step_s": timer.step_s(args.warmup), "wait_s": [r.wait_s for r in reports],
                "failed": sum(r.failed for r in rollout.reports),
                "sync_s": [r.total_s for r in sync.reports[1 + args.warmup:]],
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


def run_inprocess(args, model_dir: Path, work: Path, instances: list[dict]) -> dict:
    import trl
    from datasets import Dataset

    from rollstream.tasks import arith

    delay_s = args.tool_ms / 1000
    tool_calls = [0]

    def bash(command: str) -> str:
        """Run a shell command.

        Args:
            command: The command to run.

        Returns:
            What the command printed.
        """
        tool_calls[0] += 1
        time.sleep(delay_s)
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
    config = grpo_config(args, work / "trl-inprocess", max_tool_calling_iterations=1,
                         max_completion_length=4 * args.max_tokens,
                         generation_kwargs={"max_new_tokens": args.max_tokens})
    trainer = trl.GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=[zero_reward], args=config,
        train_dataset=Dataset.from_list([{"prompt": arith.prompt(inst)} for inst in instances]),
        tools=[bash, submit], callbacks=[timer])
    trainer.train()
    frequency = [row["tools/call_frequency"] for row in trainer.state.log_history if "tools/call_frequency" in row]
    return {"step_s": timer.step_s(args.warmup), "tool_calls": tool_calls[0],
            "call_frequency": statistics.mean(frequency) if frequency else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts per step")
    ap.add_argument("--group", type=int, default=4, help="rollouts per prompt (num_generations)")
    ap.add_argument("--tool-ms", type=float, default=50.0, help="fixed time each bash call takes")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=64, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        serve_worker(args.worker, args.concurrency)
        return

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from rollstream.llm.format_pretrain import build_arith_model
    from rollstream.pipeline.embedded import EmbeddedRedis
    from rollstream.tasks import arith

    cache = Path(os.environ.get("ROLLSTREAM_TEST_CACHE", Path.home() / ".cache" / "rollstream" / "tests"))
    model_dir = build_arith_model(cache / "arith-model")
    instances = arith.make_instances(args.prompts * (args.steps + args.warmup), seed=5)
    work = Path(tempfile.mkdtemp(prefix="rs-trl-overlap-"))
    with EmbeddedRedis(work / "redis", appendonly=False) as redis_server:
        rollstream_side = run_rollstream(args, model_dir, redis_server.url, work / "rs", instances)
    inprocess_side = run_inprocess(args, model_dir, work / "inproc", instances)

    rs_s = statistics.mean(rollstream_side["step_s"])
    ip_s = statistics.mean(inprocess_side["step_s"])
    rollouts = args.prompts * args.group
    serial_tool_s = inprocess_side["call_frequency"] * rollouts * args.tool_ms / 1000
    print(f"TRL GRPO, arith model on CPU, {args.prompts} prompts x G={args.group} = {rollouts} rollouts/step, "
          f"2 model turns, bash call +{args.tool_ms:.0f} ms, {args.steps} steps after {args.warmup} warm-up")
    print(f"{'side':<12} {'step s mean':>12} {'step s min':>11} {'step s max':>11}  notes")
    print(f"{'rollstream':<12} {rs_s:>12.2f} {min(rollstream_side['step_s']):>11.2f} "
          f"{max(rollstream_side['step_s']):>11.2f}  rollout wait {statistics.mean(rollstream_side['wait_s']):.2f} s/step,"
          f" weight sync {statistics.mean(rollstream_side['sync_s']):.2f} s/step, {rollstream_side['failed']} failed,"
          f" policy versions per step {rollstream_side['versions']}")
    print(f"{'in-process':<12} {ip_s:>12.2f} {min(inprocess_side['step_s']):>11.2f} "
          f"{max(inprocess_side['step_s']):>11.2f}  {inprocess_side['call_frequency']:.2f} bash calls/rollout: "
          f"~{serial_tool_s:.2f} s/step of serial tool time")
    print(f"speedup (in-process step / rollstream step): {ip_s / rs_s:.2f}x")
    print("RESULT " + json.dumps({
        "step_s_rollstream": round(rs_s, 3), "step_s_inprocess": round(ip_s, 3), "speedup": round(ip_s / rs_s, 3),
        "rollout_wait_s_rollstream": round(statistics.mean(rollstream_side["wait_s"]), 3),
        "weight_sync_s_rollstream": round(statistics.mean(rollstream_side["sync_s"]), 3),
        "serial_tool_s_inprocess": round(serial_tool_s, 3), "tool_ms": args.tool_ms,
        "rollouts_per_step": rollouts, "steps": args.steps, "failed_rollouts": rollstream_side["failed"]}))


if __name__ == "__main__":
    main()
