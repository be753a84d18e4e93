"""``rollstream demo``: the whole system on one machine with nothing to configure — the
embedded Redis, the built-in model server with a small local model (warmed up on the arith
task, built on first use and cached), the three pools, a few dozen rollouts across the
built-in tasks with a live progress view, a summary table that says what each row shows,
trajectories in a JSONL file, then DAPO on arith through the same pools, with weight sync
after every step, and the reward curve in the terminal and a PNG. The flags are read here;
the demo itself is rollstream/demo/."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from rollstream.cli.common import console, redis_for, settings_from
from rollstream.demo.report import print_closing
from rollstream.demo.run import local_model, quiet_transformers, run_demo


def demo(backend: str | None = typer.Option(None, "--backend", help="Use this OpenAI-compatible server "
                                               "(e.g. vLLM) instead of the built-in one; needs --model-dir."),
         model_dir: Path | None = typer.Option(None, "--model-dir", help="Tokenizer (and, for the built-in "
                                                  "server, weights) of the model; default: the local tiny model."),
         data_dir: Path | None = typer.Option(None, "--data-dir", help="Where the embedded Redis, logs, "
                                                 "trajectories and the training run go (default: the data dir)."),
         jobs: int = typer.Option(16, help="Arith rollouts (in groups of --group-size) before training."),
         group_size: int = typer.Option(4, help="Rollouts per arith prompt before training."),
         concurrency: int = typer.Option(32, help="Jobs in flight per worker process."),
         seed: int = typer.Option(0, help="Seed of the task instances and of training."),
         train_steps: int = typer.Option(12, help="DAPO steps on arith after the rollouts, 4 groups of 8 "
                                         "rollouts each (0 = none)."),
         timeout_s: float = typer.Option(240.0, help="Give up when no result came for this long.")):
    """Run the whole system end to end on this machine and print a summary."""
    quiet_transformers()
    settings = settings_from(data_dir=data_dir)
    if backend and not model_dir:
        raise typer.BadParameter("--backend needs --model-dir (the served model's tokenizer folder)")
    started = time.monotonic()
    if model_dir is None:
        model_dir = local_model(console)
    with redis_for(settings) as url:
        outcome = run_demo(url, model_dir, settings.data_dir / "demo", console, backend=backend, jobs=jobs,
                           group_size=group_size, concurrency=concurrency, seed=seed, train_steps=train_steps,
                           timeout_s=timeout_s)
    print_closing(outcome, console, time.monotonic() - started)
    if len(outcome.results) < outcome.total:
        raise SystemExit(f"only {len(outcome.results)} of {outcome.total} rollouts came back; see the worker logs")


def register(app: typer.Typer) -> None:
    app.command()(demo)
