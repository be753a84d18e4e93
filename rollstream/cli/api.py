"""``rollstream api``: serve the HTTP API with uvicorn (127.0.0.1 by default)."""

from __future__ import annotations

from pathlib import Path

import typer

from rollstream.cli.common import console, data_dir_option, namespace_option, redis_option, require_redis, settings_from


def api(redis: str | None = redis_option(), namespace: str | None = namespace_option(),
        data_dir: Path | None = data_dir_option(),
        host: str = typer.Option("127.0.0.1", help="Address to listen on; nothing public by default."),
        port: int = typer.Option(8321, help="TCP port to listen on.")):
    """Serve the HTTP API (OpenAPI spec at /openapi.json, docs at /docs)."""
    # Imported here: FastAPI and the app's models take ~0.4 s to load, which every other
    # command (and `rollstream --help`) would otherwise pay.
    import uvicorn

    from rollstream.api.app import asgi

    settings = require_redis(settings_from(redis, namespace, data_dir), "the API")
    console.print(f"API on http://{host}:{port}; token in ROLLSTREAM_API_TOKEN or {settings.data_dir / 'api-token'}")
    uvicorn.run(asgi(settings), host=host, port=port, log_level="warning")


def register(app: typer.Typer) -> None:
    app.command()(api)
