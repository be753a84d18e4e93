"""``rollstream api``: serve the HTTP API with uvicorn (127.0.0.1 by default)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def api(redis: Optional[str] = typer.Option(None, "--redis", help="Redis URL (else $REDIS_URL)."),
            namespace: Optional[str] = typer.Option(None, "--namespace"),
            data_dir: Optional[Path] = typer.Option(None, "--data-dir"),
            host: str = typer.Option("127.0.0.1", help="Address to listen on; nothing public by default."),
            port: int = typer.Option(8321)):
        """Serve the HTTP API (OpenAPI spec at /openapi.json, docs at /docs)."""
        import uvicorn

        from rollstream.api.app import asgi
        from rollstream.cli.common import console, settings_from

        settings = settings_from(redis, namespace, data_dir)
        if not settings.redis_url:
            raise typer.BadParameter("the API needs --redis or REDIS_URL")
        console.print(f"API on http://{host}:{port}; token in ROLLSTREAM_API_TOKEN or {settings.data_dir / 'api-token'}")
        uvicorn.run(asgi(settings), host=host, port=port, log_level="warning")
