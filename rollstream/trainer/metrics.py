"""What a training run reports: one JSONL row per step (reward, keep rate, tokens,
throughput, staleness, loss, clip fraction, sync time), a live progress view on a terminal,
and a reward-curve PNG at the end."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_KEYS = ("reward_mean", "keep_rate", "loss", "clip_frac", "staleness_mean", "update_tokens_per_s", "sync_s")


class MetricsLog:
    """Appends step rows to `{output_dir}/metrics.jsonl` (kept across resumes)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        # a resumed run rewrites steps after its checkpoint: keep the last row of each step
        by_step = {row["step"]: row for row in rows}
        return [by_step[s] for s in sorted(by_step)]


def plot_reward_curve(rows: list[dict[str, Any]], out_png: Path | str, title: str = "rollstream DAPO") -> Path | None:
    """Mean reward of all finished rollouts per step (and of the kept groups). Returns None
    when matplotlib is missing (pip install 'rollstream[model]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; no reward curve (pip install matplotlib)")
        return None
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("reward_mean_all", float("nan")) for r in rows], marker="o", label="all rollouts")
    ax.plot(steps, [r.get("reward_mean", float("nan")) for r in rows], alpha=0.6, label="kept groups")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


class ProgressView:
    """A rich progress bar with the latest step's numbers; silent when not on a terminal."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._progress = None
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[line]}"),
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, line="waiting for rollouts"
            )
            self._progress.start()

    def update(self, row: dict[str, Any]) -> None:
        line = "  ".join(f"{k}={row[k]:.3g}" for k in PROGRESS_KEYS if isinstance(row.get(k), (int, float)))
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], line=line)
        else:
            log.info("step %d  %s", row["step"], line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
