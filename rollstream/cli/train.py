"""``rollstream train CONFIG.toml``: DAPO training on rollouts from rollstream. The main CLI
calls ``register``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rollstream.cli.common import setup_logging
from rollstream.trainer.config import TrainConfig


def train_command(
    config: Path = typer.Argument(..., exists=True, dir_okay=False, help="TOML train config (see README 'Training')"),
    steps: int | None = typer.Option(None, help="override: training steps"),
    output_dir: Path | None = typer.Option(None, help="override: run folder (checkpoints, metrics, weights)"),
    redis: str | None = typer.Option(None, "--redis", help="override: Redis URL (else the config's, else $REDIS_URL)"),
    resume: bool = typer.Option(True, help="continue from the newest checkpoint in the run folder"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="debug logging"),
) -> None:
    """Train a policy with DAPO: submit groups, keep the batch topped up, update, sync
    weights to every backend; metrics in OUTPUT_DIR/metrics.jsonl, curve in reward_curve.png."""
    # Imported here: the training loop loads torch (seconds), which only this command needs.
    from rollstream.trainer.loop import train

    setup_logging(verbose)
    overrides: dict = {"resume": resume}
    if steps is not None:
        overrides["steps"] = steps
    if redis is not None:
        overrides["redis_url"] = redis
    cfg = TrainConfig.from_toml(config, **overrides)
    if output_dir is not None:
        cfg.output_dir = output_dir.resolve()
    summary = train(cfg)
    data = {
        "steps_done": summary.steps_done,
        "policy_version": summary.policy_version,
        "reward_first": summary.reward_first,
        "reward_last": summary.reward_last,
        "metrics": str(summary.metrics_path),
        "reward_curve": str(summary.reward_curve) if summary.reward_curve else None,
        "checkpoint": str(summary.checkpoint) if summary.checkpoint else None,
    }
    if as_json:
        print(json.dumps(data))
    else:
        for key, value in data.items():
            print(f"{key:>15}: {value}")


def register(parent: typer.Typer) -> None:
    """Mount `train` on the main `rollstream` CLI."""
    parent.command("train")(train_command)
