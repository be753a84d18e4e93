"""What the demo prints: the rollouts table (with what each row shows, since a 1M-parameter
model scores 0 on most tasks), the reward per DAPO step as bars, and the closing lines."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from rollstream.messages import Result

ROW_MEANING = {
    "arith": "sums with a bash tool: the task trained below (before training the model names "
             "submit's argument right ~1 time in 4)",
    "echo": "no model: the pipeline alone (reward 1 = the job went through every stage)",
    "math": "a math question the tiny model cannot answer: reward 0 is expected; shows sandbox, turns, scoring",
    "code": "write a function, scored by running tests in the sandbox: reward 0 is expected from the tiny model",
    "swe": "fix a repository, scored by its test suite: reward 0 is expected from the tiny model",
}


def summarize(results: list[Result], elapsed_s: float) -> Table:
    """The rollouts per task: outcomes, reward, stage times, turns and tool calls."""
    by_task: dict[str, list[Result]] = defaultdict(list)
    for res in results:
        by_task[res.task].append(res)
    table = Table(title=f"{len(results)} rollouts in {elapsed_s:.1f} s = {len(results) / elapsed_s:.2f} jobs/s",
                  title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("task", "jobs", "ok", "fail", "reward", "init s", "run s", "eval s", "turns",
                "tools", "tool ms"):
        table.add_column(col, justify="left" if col == "task" else "right", no_wrap=True)

    def mean(xs):
        return f"{statistics.fmean(xs):.2f}" if xs else "-"

    for task, rs in sorted(by_task.items()):
        ok = [r for r in rs if r.status == "completed"]
        tools = [c.duration_ms for r in ok if r.trajectory for c in r.trajectory.tool_calls if c.duration_ms > 0]
        table.add_row(task, str(len(rs)), str(len(ok)), str(len(rs) - len(ok)),
                      mean([r.reward for r in ok if r.reward is not None]),
                      mean([r.timings_s.get("init_s", 0) for r in ok]), mean([r.timings_s.get("run_s", 0) for r in ok]),
                      mean([r.timings_s.get("eval_s", 0) for r in ok]),
                      mean([r.trajectory.num_turns for r in ok if r.trajectory]), str(len(tools)),
                      f"{statistics.median(tools):.1f}" if tools else "-")
    table.caption = "\n".join(f"{task}: {ROW_MEANING[task]}" for task in sorted(by_task) if task in ROW_MEANING)
    table.caption_justify = "left"
    return table


def reward_curve_table(metrics_path: Path) -> Table:
    """The reward per training step as a bar chart in the terminal."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    table = Table(title="reward per DAPO step (mean over every rollout of the step)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("step", "reward", "", "kept groups", "step s"):
        table.add_column(col, justify="left" if col == "" else "right")
    for row in rows:
        reward = row.get("reward_mean_all") or 0.0
        table.add_row(str(row["step"]), f"{reward:.2f}", "█" * round(40 * reward) or "·",
                      f"{row.get('groups_kept', '-')}", f"{row.get('step_s', 0):.1f}")
    return table


@dataclass
class DemoOutcome:
    """What a demo run (run.run_demo) leaves for its closing lines."""

    results: list[Result]
    elapsed_s: float  # submitting and collecting the rollouts
    total: int  # rollouts submitted
    trained: Any  # the trainer's TrainSummary, or None when there was no training
    trajectories: Path
    logs: Path


def print_closing(outcome: DemoOutcome, console: Console, elapsed_s: float) -> None:
    """The training's reward curve and summary, tool-call latency, where the files are."""
    trained, results = outcome.trained, outcome.results
    if trained is not None:
        console.print(reward_curve_table(trained.metrics_path))
        first, last = (f"{x:.2f}" if x is not None else "-" for x in (trained.reward_first, trained.reward_last))
        console.print(f"trained {trained.steps_done} steps: mean reward {first} → {last}, "
                      f"policy version {trained.policy_version}; metrics {trained.metrics_path}"
                      + (f", curve {trained.reward_curve}" if trained.reward_curve else ""))
    tools = [c.duration_ms for r in results if r.trajectory for c in r.trajectory.tool_calls if c.duration_ms > 0]
    if tools:
        console.print(f"tool-call latency: p50 {statistics.median(tools):.2f} ms, "
                      f"max {max(tools):.2f} ms over {len(tools)} calls")
    console.print(f"trajectories: {outcome.trajectories}   worker logs: {outcome.logs}")
    console.print(f"demo done in {elapsed_s:.0f} s")
