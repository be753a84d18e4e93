"""CLI commands of the LLM side: `serve-model` (the built-in server), `tiny-model` (build the
small local model) and `arith-model` (the same model warmed up on the arith task's tool-call
format). The main CLI calls `register`; `python -m rollstream.cli.llm` runs `serve-model` alone, without
the other commands' imports (the server process that `llm.server.start_server_process` starts)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from rollstream.cli.common import require_redis, settings_from
from rollstream.demo.arith_model import build_arith_model
from rollstream.llm.tiny_model import build_tiny_model


def serve_model_command(
    model: Path = typer.Option(..., "--model", help="folder with a transformers causal LM (save_pretrained layout)"),
    port: int = typer.Option(8000, help="TCP port to listen on"),
    host: str = typer.Option("127.0.0.1", help="address to bind; 0.0.0.0 to serve other machines"),
    device: str = typer.Option("auto", help="auto (cuda if available), cpu, cuda, cuda:1, ..."),
    max_batch_size: int = typer.Option(64, help="most sequences stepped together"),
    max_model_len: int = typer.Option(0, help="context window in tokens; 0 = the model's max_position_embeddings"),
    served_model_name: str = typer.Option("", help="name in /v1/models; default: the folder name"),
    prefix_cache_mb: int = typer.Option(1024, help="memory for the prefix KV cache, in MiB (0 disables)"),
    logprobs_mode: str = typer.Option(
        "raw_logprobs", help="raw_logprobs (vLLM's default: before temperature/top-p) or processed_logprobs"
    ),
    log_level: str = typer.Option("warning", help="uvicorn log level"),
    register: bool = typer.Option(
        False, "--register", help="add this server to the balancer once it serves (Redis: $REDIS_URL, else the "
        "embedded Redis of 'rollstream up'; namespace: $ROLLSTREAM_NAMESPACE)"
    ),
    advertise_url: str = typer.Option("", help="URL the run workers use to reach it; default http://HOST:PORT"),
) -> None:
    """Serve a model with vLLM's completions API (token ids in, token ids + logprobs out)."""
    # Imported here: the server loads torch (seconds), which only this command needs.
    from rollstream.llm.server import registration
    from rollstream.llm.server.app import serve_model

    if logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        raise typer.BadParameter("use raw_logprobs or processed_logprobs", param_hint="--logprobs-mode")
    if not model.is_dir():
        raise typer.BadParameter(
            f"{model} is not a folder; build one with `rollstream tiny-model DIR`", param_hint="--model"
        )
    logging.basicConfig(level=log_level.upper(), format="%(message)s")
    redis_url, namespace = None, "rs"
    if register:
        settings = require_redis(settings_from(), "serve-model --register")
        redis_url, namespace = settings.redis_url, settings.namespace
        logging.getLogger(registration.__name__).setLevel(logging.INFO)  # the "registered ..." line
    url = advertise_url or f"http://{host}:{port}"
    typer.echo(
        f"serving {model} on {url} (loading the model; ready when /health answers"
        + (", then 'registered' below)" if register else ")"),
        err=True,
    )
    serve_model(
        model,
        host=host,
        port=port,
        device=device,
        max_batch_size=max_batch_size,
        max_model_len=max_model_len or None,
        served_model_name=served_model_name or None,
        prefix_cache_bytes=prefix_cache_mb << 20,
        logprobs_mode=logprobs_mode,
        log_level=log_level,
        register_redis_url=redis_url,
        namespace=namespace,
        advertise_url=advertise_url or None,
    )


def tiny_model_command(
    out_dir: Path = typer.Argument(..., help="folder to write (reused if already built with the same recipe)"),
    seed: int = typer.Option(0, help="weight initialisation seed"),
) -> None:
    """Build the ~1M-parameter local test model and its tokenizer (no download)."""
    typer.echo(str(build_tiny_model(out_dir, seed=seed)))


def arith_model_command(
    out_dir: Path = typer.Argument(..., help="folder to write (reused if already built)"),
) -> None:
    """Build the tiny model warmed up on the arith task's tool-call format (about two minutes
    on 2 cores, no download): it calls bash and submits, but rarely gets the sum right."""
    typer.echo(str(build_arith_model(out_dir)))


def register(parent: typer.Typer) -> None:
    """Mount these commands on the main `rollstream` CLI."""
    parent.command("serve-model")(serve_model_command)
    parent.command("tiny-model")(tiny_model_command)
    parent.command("arith-model")(arith_model_command)


if __name__ == "__main__":
    typer.run(serve_model_command)
